"""Prompts and answers of a run: synthetic tasks (the tiny example) or your own JSONL files.

    held_out = held_out_problems(config.task)                     # greedy-accuracy prompts
    problems = training_problems(config.task, 16, seed=0, step=7, held_out=held_out)
    write_sft_data("sft.jsonl", config.task, steps=60, batch_size=32)  # the SFT warm start's

The problems of a step depend only on (seed, step), so a resumed run sees exactly the prompts it
would have seen without the interruption. Held-out prompts never appear in training. A JSONL
task reads {"prompt": ..., "label": ...} lines (keys configurable); the label goes to the reward
function as the sample's `label`. The rewards that fit the synthetic tasks are ferrule-rewards'
`builtin:char_match` (partial credit) and `builtin:exact_text` (what `accuracy` counts).
"""

import functools
import json
import random
from pathlib import Path

Problem = tuple[str, str]  # (prompt, answer)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def problem(name: str, length: int, rng: random.Random) -> Problem:
    """One problem; the answer is what the model should write after the prompt."""
    if name == "reversal":
        word = "".join(rng.choice(LETTERS) for _ in range(length))
        return f"Reverse the string {word}. Answer:", f" {word[::-1]}"
    if name == "arithmetic":
        a, b = rng.randint(0, 10**length - 1), rng.randint(0, 9)
        return f"Question: what is {a} + {b}? Answer:", f" {a + b}"
    raise ValueError(f"unknown task {name!r}; choose reversal or arithmetic")


def eval_problems(name: str, length: int, count: int, seed: int) -> list[Problem]:
    """`count` distinct held-out problems (fewer when the task has fewer)."""
    rng, found = random.Random(f"eval-{seed}"), {}
    for _ in range(count * 50):
        prompt, answer = problem(name, length, rng)
        found.setdefault(prompt, answer)
        if len(found) == count:
            break
    return list(found.items())


def step_problems(
    name: str, length: int, count: int, seed: int, step: int, exclude: list[Problem]
) -> list[Problem]:
    """The training problems of one step (step < 0 for the SFT warm start's steps)."""
    rng, held_out, chosen = random.Random(f"train-{seed}-{step}"), {p for p, _ in exclude}, []
    while len(chosen) < count:
        prompt, answer = problem(name, length, rng)
        if prompt not in held_out:
            chosen.append((prompt, answer))
    return chosen


def accuracy(responses: list[str], problems: list[Problem]) -> float:
    from ferrule_rewards.builtin import exact_text

    hits = sum(exact_text(r, a) for r, (_, a) in zip(responses, problems, strict=True))
    return hits / max(len(problems), 1)


@functools.cache
def read_jsonl(path: Path, prompt_key: str, label_key: str) -> tuple[Problem, ...]:
    """(prompt, label) rows; an error names the file and the line."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON: {err}") from None
        if not isinstance(record.get(prompt_key), str):
            raise ValueError(f"{path}:{number}: needs a string {prompt_key!r}")
        rows.append((record[prompt_key], str(record.get(label_key, ""))))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return tuple(rows)


def held_out_problems(task) -> list[Problem]:
    """The held-out problems of a [task] table (config.TaskConfig)."""
    if task.name == "jsonl":
        return list(read_jsonl(task.eval_file, task.prompt_key, task.label_key))[
            : task.eval_prompts
        ]
    return eval_problems(task.name, task.length, task.eval_prompts, task.seed)


def training_problems(task, count: int, seed: int, step: int, held_out) -> list[Problem]:
    """The `count` training problems of `step` for a [task] table."""
    if task.name == "jsonl":
        rows = read_jsonl(task.train_file, task.prompt_key, task.label_key)
        rng = random.Random(f"train-{seed}-{step}")
        return rng.sample(rows, count) if count <= len(rows) else rng.choices(rows, k=count)
    return step_problems(task.name, task.length, count, seed, step, held_out)


def write_sft_data(path: Path, task, steps: int, batch_size: int) -> None:
    """The SFT warm start's examples, {"prompt", "response"} per line: `steps` batches of the
    task's problems with their answers, drawn from negative steps, so never the RL prompts and
    never the held-out ones."""
    held_out = eval_problems(task.name, task.length, task.eval_prompts, task.seed)
    with open(path, "w") as f:
        for step in range(steps):
            for prompt, answer in step_problems(
                task.name, task.length, batch_size, task.seed, -1 - step, held_out
            ):
                f.write(json.dumps({"prompt": prompt, "response": answer}) + "\n")
