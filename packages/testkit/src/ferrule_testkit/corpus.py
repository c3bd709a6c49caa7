"""Synthetic text for training the kit tokenizer: arithmetic, string reversal and plain prose.

Deterministic for a seed. The mix covers what Ferrule's example tasks need (digits, operators,
short words) so that task text tokenizes into few, meaningful pieces.
"""

import random

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "be",
    "this",
    "from",
    "or",
    "are",
    "model",
    "reward",
    "answer",
    "question",
    "what",
    "reverse",
    "string",
    "sum",
    "add",
    "plus",
    "minus",
    "times",
    "equals",
    "number",
    "step",
    "policy",
    "value",
    "token",
    "train",
    "learn",
    "sample",
    "prompt",
    "response",
    "correct",
    "wrong",
    "good",
    "bad",
    "yes",
    "no",
]


def arithmetic_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Question: what is {a} {op} {b}? Answer: {result}"


def reversal_line(rng: random.Random) -> str:
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
    return f"Reverse the string {word}. Answer: {word[::-1]}"


def prose_line(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 16))).capitalize() + "."


def synthetic_corpus(seed: int, lines: int = 20_000) -> list[str]:
    """`lines` lines of mixed synthetic text, the same list for the same seed."""
    rng = random.Random(seed)
    makers = (arithmetic_line, reversal_line, prose_line)
    return [rng.choice(makers)(rng) for _ in range(lines)]
