"""The prompts of a run: synthetic tasks (the tiny example), or your own data (data.py).

    prompts = data.make_prompts(config)               # SyntheticPrompts or data.DataPrompts
    prompts.held_out                                  # the evaluations' prompts
    batch = prompts.draw(step=7, draw=0, count=16)    # list[Problem]
    write_sft_data("sft.jsonl", config.task, steps=60, batch_size=32)  # SFT warm-start data

The prompts of a step depend only on (seed, step, draw), so a resumed run sees exactly the
prompts it would have seen without the interruption. Held-out prompts never appear in a
synthetic task's training. The rewards that fit the synthetic tasks are ferrule-rewards'
`builtin:char_match` (partial credit) and `builtin:exact_text` (what `accuracy` counts).
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

QA = tuple[str, str]  # (prompt, answer)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Problem:
    """A prompt, its label (passed as the reward function's `label`), the source its metrics
    are grouped under, and metadata for the reward function (string pairs)."""

    text: str
    label: str = ""
    source: str = ""
    metadata: tuple[tuple[str, str], ...] = ()


DRAW_SEED_STRIDE = 1_000_003
"""Replacement draws within a step (DAPO's dynamic sampling) use seed + stride x draw, so each
draw gets its own stream of problems instead of the dropped groups again."""


def problem(name: str, length: int, rng: random.Random) -> QA:
    """One problem; the answer is what the model should write after the prompt."""
    if name == "reversal":
        word = "".join(rng.choice(LETTERS) for _ in range(length))
        return f"Reverse the string {word}. Answer:", f" {word[::-1]}"
    if name == "arithmetic":
        a, b = rng.randint(0, 10**length - 1), rng.randint(0, 9)
        return f"Question: what is {a} + {b}? Answer:", f" {a + b}"
    raise ValueError(f"unknown task {name!r}; choose reversal or arithmetic")


def eval_problems(name: str, length: int, count: int, seed: int) -> list[QA]:
    """`count` distinct held-out problems (fewer when the task has fewer)."""
    rng, found = random.Random(f"eval-{seed}"), {}
    for _ in range(count * 50):
        prompt, answer = problem(name, length, rng)
        found.setdefault(prompt, answer)
        if len(found) == count:
            break
    return list(found.items())


def step_problems(
    name: str, length: int, count: int, seed: int, step: int, exclude: list[QA]
) -> list[QA]:
    """The training problems of one step (step < 0 for the SFT warm start's steps)."""
    rng, held_out, chosen = random.Random(f"train-{seed}-{step}"), {p for p, _ in exclude}, []
    while len(chosen) < count:
        prompt, answer = problem(name, length, rng)
        if prompt not in held_out:
            chosen.append((prompt, answer))
    return chosen


def accuracy(responses: list[str], prompts: list[Problem]) -> float:
    from ferrule_rewards.builtin import exact_text

    hits = sum(exact_text(r, p.label) for r, p in zip(responses, prompts, strict=True))
    return hits / max(len(prompts), 1)


class SyntheticPrompts:
    """The prompts of a synthetic task ([task] name = "reversal" or "arithmetic"), with the same
    interface as data.DataPrompts. Every step draws fresh problems, so there are no epochs."""

    def __init__(self, task, seed: int):
        self.task, self.seed = task, seed
        problems = eval_problems(task.name, task.length, task.eval_prompts, task.seed)
        self.held_out = [Problem(p, a, task.name) for p, a in problems]
        self._excluded = problems

    def draw(self, step: int, draw: int, count: int) -> list[Problem]:
        seed = self.seed + DRAW_SEED_STRIDE * draw
        problems = step_problems(
            self.task.name, self.task.length, count, seed, step, self._excluded
        )
        return [Problem(p, a, self.task.name) for p, a in problems]

    def epochs(self, position: int) -> dict[str, float]:
        return {}

    def describe(self) -> str:
        return f"{self.task.name}: fresh problems every step, {len(self.held_out)} held-out"

    def summary(self) -> dict:
        return {}


def write_sft_data(path: Path, task, steps: int, batch_size: int) -> None:
    """Write the SFT warm start's examples, one {"prompt", "response"} object per line: `steps`
    batches of the task's problems with their answers. They are drawn as negative steps, so
    they are never the RL prompts and never the held-out ones."""
    held_out = eval_problems(task.name, task.length, task.eval_prompts, task.seed)
    with open(path, "w") as f:
        for step in range(steps):
            for prompt, answer in step_problems(
                task.name, task.length, batch_size, task.seed, -1 - step, held_out
            ):
                f.write(json.dumps({"prompt": prompt, "response": answer}) + "\n")
