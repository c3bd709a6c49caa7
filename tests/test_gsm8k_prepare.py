"""examples/gsm8k/prepare.py on a small synthetic file in GSM8K's format (Parquet and JSONL)."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ferrule_testkit import tiny_tokenizer

SCRIPT = Path(__file__).parents[1] / "examples" / "gsm8k" / "prepare.py"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROWS = [
    {"question": "Ava has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A car costs $1,200 ... ", "answer": "It costs 1,200.\n#### 1,200"},
    {"question": "Half of 5?", "answer": "5 / 2 = 2.5\n#### 2.5"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tokenizer folder with a chat template, as a policy's folder has."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer())
    tokenizer.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("model")
    tokenizer.save_pretrained(folder)
    return folder


def run(*args) -> int:
    """The script's main() in this process (a subprocess would import transformers again)."""
    spec = importlib.util.spec_from_file_location("gsm8k_prepare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(arg) for arg in args])


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_rows_get_the_chat_template_and_the_final_number(tmp_path, model, suffix):
    source = tmp_path / f"train{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), source)
    else:
        source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path / "data" / "train.jsonl"
    assert run("--model", model, "--input", source, "--output", out) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["label"] for row in rows] == ["7", "1200", "2.5"]
    assert rows[0]["prompt"].startswith("<|user|>Ava has 3 apples and buys 4 more. How many?")
    assert rows[0]["prompt"].endswith(
        '"#### <number>", giving the final number only.\n<|assistant|>'
    )


def test_a_row_without_a_final_number_is_named(tmp_path, model, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": "a"}))
    assert run("--model", model, "--input", source, "--output", tmp_path / "out.jsonl") == 2
    assert 'bad.jsonl: row 2: no "#### <number>"' in capsys.readouterr().err
