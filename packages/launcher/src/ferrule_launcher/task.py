"""Synthetic tasks for the tiny example: prompts, answers, held-out sets and the rule reward.

    held_out = eval_problems("reversal", length=3, count=100, seed=0)
    prompts = step_problems("reversal", length=3, count=16, seed=0, step=7, exclude=held_out)
    rlhf-rewards serve --function ferrule_launcher.task:char_match     # or :exact_answer

The problems of a step depend only on (seed, step), so a resumed run sees exactly the prompts it
would have seen without the interruption. Held-out prompts never appear in training.
"""

import random

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


def exact_answer(response: str, label: str) -> float:
    """1.0 when the response, stripped, is exactly the answer, else 0.0 (a ferrule-rewards
    per-sample function)."""
    return float(response.strip() == label.strip())


def char_match(response: str, label: str) -> float:
    """Partial credit: the fraction of the answer's characters that the response has at the
    same position (1.0 exactly when it is the answer). A tiny model's early samples are rarely
    exactly right; partial credit gives GRPO a signal to climb from there."""
    response, label = response.strip(), label.strip()
    hits = sum(a == b for a, b in zip(response, label, strict=False))
    return hits / max(len(response), len(label), 1)


def accuracy(responses: list[str], problems: list[Problem]) -> float:
    hits = sum(exact_answer(r, a) for r, (_, a) in zip(responses, problems, strict=True))
    return hits / max(len(problems), 1)
