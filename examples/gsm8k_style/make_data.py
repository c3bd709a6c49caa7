"""Rebuild the GSM8K-style example's data: `uv run python examples/gsm8k_style/make_data.py`.

Arithmetic word problems in GSM8K's shape (a question in words, worked reasoning, the answer a
number after "####"), generated from templates with a fixed seed, so that the example runs
without a download. Two sources of different difficulty, in two of the formats a source may
take:
    one_step.jsonl / one_step_test.jsonl        one operation   ("3 + 4 = 7.")
    two_step.parquet / two_step_test.parquet    two operations  ("3 * 12 = 36. 36 - 5 = 31.")
    sft.jsonl                                   worked examples of both, for the SFT warm start
Each row: {"prompt": "Question: ...\\nAnswer:", "answer": <int>, "info": {"steps": n}}; the SFT
rows: {"prompt": ..., "response": " <reasoning>\\n#### <answer>"}. Test questions never appear in
training or SFT rows.
"""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).parent
NAMES = ["Ava", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "June", "Kai", "Lena"]
ITEMS = ["apples", "books", "coins", "stamps", "pens", "shells", "cards", "marbles"]


def one_step(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    if rng.random() < 0.5:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?"
        return question, f"{a} + {b} = {a + b}.", a + b
    a += b
    question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
    return question, f"{a} - {b} = {a - b}.", a - b


def two_step(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, each = rng.randint(2, 9), rng.randint(2, 12)
    total = boxes * each
    if rng.random() < 0.5:
        extra = rng.randint(1, 30)
        question = (
            f"{name} has {boxes} boxes with {each} {item} in each box and finds {extra} more "
            f"{item}. How many {item} does {name} have?"
        )
        return (
            question,
            f"{boxes} * {each} = {total}. {total} + {extra} = {total + extra}.",
            total + extra,
        )
    lost = rng.randint(2, total - 1)
    question = (
        f"{name} has {boxes} boxes with {each} {item} in each box and loses {lost} {item}. "
        f"How many {item} are left?"
    )
    return question, f"{boxes} * {each} = {total}. {total} - {lost} = {total - lost}.", total - lost


def rows(make, count: int, rng: random.Random, taken: set[str]) -> list[tuple[str, str, int]]:
    """`count` problems whose questions are not in `taken` (which they join)."""
    found = []
    while len(found) < count:
        question, reasoning, answer = make(rng)
        if question not in taken:
            taken.add(question)
            found.append((question, reasoning, answer))
    return found


def prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def main() -> None:
    rng, taken = random.Random(0), set()
    sources = {"one_step": (one_step, 1), "two_step": (two_step, 2)}
    test = {name: rows(make, 50, rng, taken) for name, (make, _) in sources.items()}
    train = {name: rows(make, 300, rng, taken) for name, (make, _) in sources.items()}
    sft = [r for make, _ in sources.values() for r in rows(make, 200, rng, taken)]
    for name, (_, steps) in sources.items():
        for part, problems in ((name, train[name]), (f"{name}_test", test[name])):
            table = [
                {"prompt": prompt(q), "answer": answer, "info": {"steps": steps}}
                for q, _, answer in problems
            ]
            if name == "one_step":
                (OUT / f"{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table))
            else:
                pq.write_table(pa.Table.from_pylist(table), OUT / f"{part}.parquet")
    rng.shuffle(sft)
    lines = [
        json.dumps({"prompt": prompt(q), "response": f" {reasoning}\n#### {answer}"})
        for q, reasoning, answer in sft
    ]
    (OUT / "sft.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {', '.join(sorted(p.name for p in OUT.glob('*.*') if p.suffix != '.py'))}")


if __name__ == "__main__":
    main()
