"""A synthetic preference task: the correct reversal of a word is preferred.

    rows = reversal_pairs(512, seed=1)   # [{"prompt", "chosen", "rejected"}, ...]

The prompt is the tiny example's ("Reverse the string abc. Answer:"); the chosen response the
reversed word (" cba"); the rejected one, half the time, the same letters in another order, and
otherwise the reversal of another word. Deterministic for a seed.
"""

import itertools
import random

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reversal_pairs(count: int, seed: int) -> list[dict]:
    rng, rows = random.Random(seed), []
    while len(rows) < count:
        word = "".join(rng.sample(LETTERS, 3))
        if rng.random() < 0.5:  # the right letters in a wrong order
            wrong = [w for w in map("".join, itertools.permutations(word)) if w != word[::-1]]
            rejected = rng.choice(wrong)
        else:  # the reversal of another word
            rejected = "".join(rng.sample(LETTERS, 3))[::-1]
        rows.append(
            {
                "prompt": f"Reverse the string {word}. Answer:",
                "chosen": f" {word[::-1]}",
                "rejected": f" {rejected}",
            }
        )
    return rows
