"""Prompt datasets (data.py): the three formats, epochs and an exact mid-epoch resume, mixing
ratios, the length filter, and errors that name the file and the row."""

import json
from collections import Counter
from pathlib import Path

import pytest

from ferrule_launcher.config import SourceConfig, TaskConfig
from ferrule_launcher.data import DataError, DataPrompts, Source, read_rows
from ferrule_launcher.task import Problem

TOKENIZER = str(Path(__file__).parents[3] / "examples" / "tiny" / "model")


def source(name: str, size: int, weight: float = 1.0) -> Source:
    rows = [Problem(f"{name}-{i}", str(i), name) for i in range(size)]
    return Source(name, weight, rows, rows[:2])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(tmp_path, *entries: dict, limit: int = 100, eval_prompts: int = 100) -> DataPrompts:
    task = TaskConfig(
        name="data",
        sources=[SourceConfig(**entry) for entry in entries],
        eval_prompts=eval_prompts,
    )
    return DataPrompts.load(task, TOKENIZER, limit, seed=0)


def test_an_epoch_takes_every_row_once_in_a_seeded_order_new_each_epoch():
    prompts = DataPrompts([source("a", 10)], seed=0)
    stream = [p.text for step in range(1, 6) for p in prompts.draw(step, 0, count=4)]
    first, second = stream[:10], stream[10:20]
    assert sorted(first) == sorted(second) == sorted(f"a-{i}" for i in range(10))
    assert first != second and first != sorted(first)  # shuffled, anew each epoch
    assert prompts.epochs(position=4 * 5) == {"a": 2.0}
    assert prompts.epochs(position=3) == {"a": 0.3}
    reseeded = DataPrompts([source("a", 10)], seed=1)
    assert [p.text for p in reseeded.draw(1, 0, 10)] != first


def test_a_resumed_run_continues_mid_epoch_with_exactly_the_same_prompts():
    """Nothing is saved but the step: a new DataPrompts drawing step 6 first (as a run resumed
    after step 5 does) gets what the uninterrupted one drew at step 6, and so on."""
    sources = [source("a", 7, 2.0), source("b", 5, 1.0)]
    uninterrupted = DataPrompts(sources, seed=3)
    expected = [uninterrupted.draw(step, 0, 6) for step in range(1, 13)]
    resumed = DataPrompts([source("a", 7, 2.0), source("b", 5, 1.0)], seed=3)
    assert [resumed.draw(step, 0, 6) for step in range(6, 13)] == expected[5:]
    # and across the stream's blocks of positions: step 1000 of 6 is position 5994
    assert resumed.draw(1000, 0, 6) == uninterrupted.draw(1000, 0, 6)


def test_replacement_draws_are_seeded_and_leave_the_epochs_alone():
    prompts = DataPrompts([source("a", 10)], seed=0)
    first_draws = [prompts.draw(step, 0, 4) for step in (1, 2)]
    replacement = prompts.draw(1, 1, 4)
    assert replacement == DataPrompts([source("a", 10)], seed=0).draw(1, 1, 4)
    assert replacement != prompts.draw(1, 2, 4)
    assert [prompts.draw(step, 0, 4) for step in (1, 2)] == first_draws


def test_sources_mix_by_weight_and_each_runs_its_own_epochs():
    prompts = DataPrompts([source("a", 30, 3.0), source("b", 1000, 1.0)], seed=0)
    drawn = [p for step in range(1, 101) for p in prompts.draw(step, 0, 40)]  # 4000 prompts
    share = Counter(p.source for p in drawn)["a"] / len(drawn)
    assert abs(share - 0.75) < 0.02  # binomial sd 0.0068
    a_rows = [p.text for p in drawn if p.source == "a"]
    for epoch in range(len(a_rows) // 30):  # a's 30 rows, each once per epoch
        assert len(set(a_rows[30 * epoch : 30 * (epoch + 1)])) == 30
    epochs = prompts.epochs(4000)
    assert epochs["a"] == pytest.approx(share * 4000 / 30)
    assert epochs["b"] == pytest.approx((1 - share) * 4000 / 1000)


def test_jsonl_parquet_and_saved_datasets_read_the_same(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"q": "What is 2 + 3?", "a": 5, "meta": {"level": 1, "tag": "add"}, "source": "easy"},
        {"q": "What is 7 * 6?", "a": 42, "meta": {"level": 2, "tag": "mul"}},
    ]
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dict")
    )
    keys = {"prompt_key": "q", "label_key": "a", "metadata_key": "meta", "name": "arith"}
    loaded = {}
    for path in (jsonl, tmp_path / "rows.parquet"):
        loaded[path.suffix] = load(tmp_path, {"path": path, "eval_path": path, **keys})
    loaded["saved"] = load(tmp_path, {"path": tmp_path / "saved", "eval_path": jsonl, **keys})
    loaded["dict"] = load(
        tmp_path, {"path": tmp_path / "dict", "eval_path": jsonl, "eval_split": "x", **keys}
    )
    expected = [
        Problem("What is 2 + 3?", "5", "easy", (("level", "1"), ("tag", "add"))),
        Problem("What is 7 * 6?", "42", "arith", (("level", "2"), ("tag", "mul"))),
    ]
    for name, prompts in loaded.items():
        assert prompts.sources[0].train == expected, name
    assert loaded[".jsonl"].held_out == expected


def test_prompts_over_the_length_limit_are_dropped_and_counted(tmp_path):
    short, long = "Reverse the string abc. Answer:", "Reverse the string abc. " * 40
    rows = [{"prompt": short, "label": "x"}] * 3 + [{"prompt": long, "label": "y"}] * 2
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    prompts = load(tmp_path, {"path": path, "eval_path": path}, limit=30, eval_prompts=2)
    (only,) = prompts.sources
    assert [p.text for p in only.train] == [short] * 3 and len(only.held_out) == 2
    assert only.dropped == {"train": 2, "held_out": 2}
    assert prompts.summary()["data"]["t"]["dropped_too_long"] == {"train": 2, "held_out": 2}
    assert "t: 3 training / 2 held-out prompts, weight 1, 4 too long dropped" in prompts.describe()
    with pytest.raises(
        DataError, match=r"t.jsonl: no prompts left: all 5 are longer than 3 tokens"
    ):
        load(tmp_path, {"path": path, "eval_path": path}, limit=3)


@pytest.mark.parametrize(
    ("text", "entry", "expected"),
    [
        ('{"prompt": "a"}\n{"prompt": \n', {}, r"t.jsonl:2: not JSON"),
        ('["a"]\n', {}, r"t.jsonl:1: expected a JSON object"),
        (
            '{"prompt": "a"}\n{"question": "b"}\n',
            {},
            r"t.jsonl: row 2: needs a non-empty string or chat",
        ),
        (
            '{"prompt": ""}\n',
            {},
            r"row 1: needs a non-empty string or chat messages 'prompt' \(keys: \['prompt'\]",
        ),
        (
            '{"prompt": [{"role": "user", "content": "hi"}]}\n',
            {},
            r"t.jsonl: row 1: chat messages need a tokenizer with a chat template",
        ),
        (
            '{"prompt": [{"role": "robot", "content": "hi"}]}\n',
            {},
            r"t.jsonl: row 1: message 1 must be",
        ),
        ('{"prompt": "a", "m": [1]}\n', {"metadata_key": "m"}, r"row 1: 'm' must be an object"),
        ("\n\n", {}, r"t.jsonl: no prompts$"),
    ],
)
def test_bad_rows_are_named(tmp_path, text, entry, expected):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=expected):
        load(tmp_path, {"path": path, "eval_path": path, **entry})


def test_bad_files_are_named(tmp_path):
    import datasets

    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable Parquet file"):
        read_rows(tmp_path / "bad.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}])}).save_to_disk(
        str(tmp_path / "dict")
    )
    with pytest.raises(DataError, match=r"a DatasetDict with splits \['train'\]; split 'test'"):
        read_rows(tmp_path / "dict", "test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: not a datasets.save_to_disk folder"):
        read_rows(tmp_path / "empty")


def test_chat_message_prompts_render_as_the_trainer_renders_them(tmp_path):
    from transformers import AutoTokenizer

    from ferrule_trainer.chat import prompt_text

    model = tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    )
    tokenizer.save_pretrained(model)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": messages, "label": "5"}])
    task = TaskConfig(name="data", sources=[SourceConfig(path=path, eval_path=path)])
    prompts = DataPrompts.load(task, str(model), 100, seed=0)
    assert prompts.held_out[0].text == prompt_text(tokenizer, messages, "x")
    assert prompts.held_out[0].text.startswith("[user] What is 2 + 3?")
