"""Turn GSM8K from a local file into the prompt / label rows `rlhf-launch` reads.

    uv run python examples/gsm8k/prepare.py --model models/Qwen2.5-1.5B-Instruct \\
        --input gsm8k/main/train-00000-of-00001.parquet --output data/gsm8k/train.jsonl

The input is GSM8K as Hugging Face publishes it (Parquet, or JSONL with the same columns): a
`question`, and an `answer` of worked reasoning that ends with "#### <number>". Each output line
is {"prompt": ..., "label": ...}: the prompt is the question with an instruction to end with
"#### <number>", rendered with the model's chat template (its generation prompt included), and
the label is the final number alone ("1,000" -> "1000"), as ferrule-rewards' `math_reward` and
`number_match` compare it.
"""

import argparse
import json
import re
import sys
from pathlib import Path

INSTRUCTION = (
    "Solve the problem step by step. End your answer with a last line of the form "
    '"#### <number>", giving the final number only.'
)
FINAL = re.compile(r"####\s*(.+?)\s*$")


def read_rows(path: Path) -> list[dict]:
    """The rows of a GSM8K Parquet or JSONL file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def final_number(answer: str) -> str:
    """The number after GSM8K's "####", without thousands separators or a trailing period."""
    found = FINAL.search(answer.strip().splitlines()[-1]) if answer.strip() else None
    if not found:
        raise ValueError(f'no "#### <number>" at the end of the answer {answer[-80:]!r}')
    number = found.group(1).replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?\d+(\.\d+)?", number):
        raise ValueError(f'"#### {found.group(1)}" is not a number')
    return number


def prepare(rows: list[dict], tokenizer, where: str) -> list[dict]:
    """prompt / label rows; a row without a question or a final number raises, naming it."""
    out = []
    for number, row in enumerate(rows, 1):
        try:
            question, answer = row["question"], row["answer"]
            label = final_number(answer)
        except (KeyError, ValueError) as err:
            raise ValueError(f"{where}: row {number}: {err}") from None
        messages = [{"role": "user", "content": f"{question.strip()}\n\n{INSTRUCTION}"}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append({"prompt": prompt, "label": label})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the policy's folder (its tokenizer)")
    parser.add_argument("--input", required=True, type=Path, help="GSM8K .parquet or .jsonl")
    parser.add_argument("--output", required=True, type=Path, help="the .jsonl to write")
    parser.add_argument("--limit", type=int, default=0, help="keep the first N rows (0: all)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if not tokenizer.chat_template:
        print(f"prepare.py: {args.model} has no chat template", file=sys.stderr)
        return 2
    try:
        rows = prepare(read_rows(args.input), tokenizer, str(args.input))
    except ValueError as err:
        print(f"prepare.py: {err}", file=sys.stderr)
        return 2
    rows = rows[: args.limit] if args.limit else rows
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
