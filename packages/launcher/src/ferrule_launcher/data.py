"""A run's prompt datasets: your own files, mixed, read in epochs, resumable exactly mid-epoch.

    prompts = make_prompts(config)            # SyntheticPrompts, or DataPrompts for "data"
    prompts = DataPrompts.load(config.task, tokenizer_path, max_prompt_tokens=250, seed=0)
    prompts.held_out                          # every source's evaluation prompts
    batch = prompts.draw(step=7, draw=0, count=16)
    prompts.epochs(position=7 * 16)           # {"gsm8k": 1.31, ...}: passes made over each source

A source ([[task.sources]]) is a JSONL file, a Parquet file or a `datasets.save_to_disk` folder.
Each row gives a prompt and a label (passed as the reward function's `label`). A row may also
have a metadata column (a JSON object passed as the reward function's `metadata`, beside `step`
and `sample_id`) and a `source` column (the name the row's metrics are grouped under; the
source's `name` when the column is absent).

Order. The first draw of step s takes positions (s-1)P .. sP-1 of one endless mixed stream,
where P is the step's prompt count. Each position belongs to a source picked by a seeded draw
weighted by the sources' `weight`. A source's k-th position gets entry k mod N of the source's
shuffle for epoch k div N, a seeded permutation of its N rows. So every row comes once per
epoch, and the whole order is a function of (seed, position). A resumed run therefore continues
mid-epoch with exactly the prompts the interrupted run would have drawn, without a saved
cursor. The replacement draws of DAPO's dynamic sampling (draw > 0) pick rows at random from a
seeded stream of their own, and do not advance the epochs.

Prompts longer than `max_prompt_tokens` (counted with the model's tokenizer) are dropped when
the data is loaded, and counted in `dropped`: in training they would leave no room for a
response.
"""

import bisect
import functools
import json
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ferrule_launcher.task import Problem, SyntheticPrompts

BLOCK = 4096  # the sources of this many positions of the mixed stream are drawn at once


class DataError(ValueError):
    """A data file cannot be used; the message names the file (and the row) and what is
    wrong."""


def read_rows(path: Path, split: str | None = None) -> list[dict]:
    """The rows of a JSONL file, a Parquet file, or a `datasets.save_to_disk` folder (a
    DatasetDict folder needs `split`)."""
    path = Path(path)
    if path.is_dir():
        return _read_saved_dataset(path, split)
    if path.suffix == ".parquet":
        import pyarrow.parquet

        try:
            return pyarrow.parquet.read_table(path).to_pylist()
        except Exception as err:  # pyarrow's errors have no common base worth naming
            raise DataError(f"{path}: not a readable Parquet file: {err}") from None
    return _read_jsonl(path)


def _read_jsonl(path: Path) -> list[dict]:
    from ferrule_trainer.jsonl import records

    try:
        return [row for _, row in records(path)]
    except ValueError as err:
        raise DataError(str(err)) from None


def _read_saved_dataset(path: Path, split: str | None) -> list[dict]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(f"{path}: not a datasets.save_to_disk folder: {err}") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(
                f"{path}: a DatasetDict with splits {sorted(saved)}; split {split!r} is not one"
            )
        saved = saved[split]
    return saved.to_list()


def prompts_of(rows: list[dict], where: str, source, tokenizer=None) -> list[Problem]:
    """Problem objects of a source's rows (`source` is the [[task.sources]] entry). An error
    names the file, the row and the key. A prompt may be chat messages, which are rendered with
    `tokenizer`'s chat template (by ferrule-trainer's chat.py, as in every entry point)."""
    from ferrule_trainer.chat import prompt_text

    prompts = []
    for number, row in enumerate(rows, 1):
        text = row.get(source.prompt_key)
        if not text or not isinstance(text, str | list):
            raise DataError(
                f"{where}: row {number}: needs a non-empty string or chat messages "
                f"{source.prompt_key!r} (keys: {sorted(row)})"
            )
        try:
            text = prompt_text(tokenizer, text, f"{where}: row {number}")
        except ValueError as err:
            raise DataError(str(err)) from None
        label = row.get(source.label_key)
        metadata = row.get(source.metadata_key) if source.metadata_key else None
        if metadata is not None and not isinstance(metadata, dict):
            raise DataError(
                f"{where}: row {number}: {source.metadata_key!r} must be an object, got "
                f"{type(metadata).__name__}"
            )
        name = row.get(source.source_key)
        prompts.append(
            Problem(
                text,
                "" if label is None else label if isinstance(label, str) else json.dumps(label),
                name if isinstance(name, str) and name else source.name,
                tuple((str(k), _as_text(v)) for k, v in (metadata or {}).items()),
            )
        )
    return prompts


def _as_text(value) -> str:
    """Metadata travels as strings; anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(eq=False)  # hashed by identity: order() caches per source
class Source:
    name: str
    weight: float
    train: list[Problem]
    held_out: list[Problem]
    dropped: dict[str, int] = field(default_factory=dict)  # {"train": n, "held_out": n}

    @functools.lru_cache(maxsize=8)  # noqa: B019 (a few Sources per process; the recent epochs)
    def order(self, epoch: int, seed: int) -> list[int]:
        """The row order of `epoch`: a seeded shuffle, different for each epoch and source."""
        order = list(range(len(self.train)))
        random.Random(f"epoch-{seed}-{self.name}-{epoch}").shuffle(order)
        return order

    def row(self, k: int, seed: int) -> Problem:
        """The source's k-th prompt in training order."""
        epoch, offset = divmod(k, len(self.train))
        return self.train[self.order(epoch, seed)[offset]]


def _load_part(source, path: Path, split: str, tokenizer, max_prompt_tokens: int):
    """The prompts of one file of a source that fit max_prompt_tokens, and how many did not."""
    where = f"{path}" + (f" [{split}]" if Path(path).is_dir() else "")
    prompts = prompts_of(read_rows(path, split), where, source, tokenizer)
    if not prompts:
        raise DataError(f"{where}: no prompts")
    lengths = [len(ids) for ids in tokenizer([p.text for p in prompts])["input_ids"]]
    kept = [p for p, n in zip(prompts, lengths, strict=True) if n <= max_prompt_tokens]
    if not kept:
        raise DataError(
            f"{where}: no prompts left: all {len(prompts)} are longer than {max_prompt_tokens} "
            "tokens ([task] max_prompt_tokens)"
        )
    return kept, len(prompts) - len(kept)


class DataPrompts:
    """The prompts of a `[task] name = "data"` run (see the module docstring)."""

    def __init__(self, sources: list[Source], seed: int):
        self.sources, self.seed = sources, seed
        total = sum(s.weight for s in sources)
        self.cumulative = [
            sum(s.weight for s in sources[: i + 1]) / total for i in range(len(sources))
        ]
        self.held_out = [p for s in sources for p in s.held_out]
        self._counts: list[list[int]] = [[0] * len(sources)]  # per-source counts before each block
        self._counting = threading.Lock()  # async: the producer draws while the trainer reports

    @classmethod
    def load(cls, task, tokenizer_path: str, max_prompt_tokens: int, seed: int) -> "DataPrompts":
        """Read, check and length-filter every source of a [task] table (config.TaskConfig)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        sources = []
        for entry in task.sources:
            train, dropped_train = _load_part(
                entry, entry.path, entry.split, tokenizer, max_prompt_tokens
            )
            held_out, dropped_held_out = [], 0
            if entry.eval_path is not None:
                held_out, dropped_held_out = _load_part(
                    entry, entry.eval_path, entry.eval_split, tokenizer, max_prompt_tokens
                )
            dropped = {"train": dropped_train, "held_out": dropped_held_out}
            sources.append(
                Source(entry.name, entry.weight, train, held_out[: task.eval_prompts], dropped)
            )
        return cls(sources, seed)

    def draw(self, step: int, draw: int, count: int) -> list[Problem]:
        """The `count` prompts of draw `draw` of `step` (steps count from 1)."""
        if draw > 0:  # replacements: a stream of their own, at random
            rng = random.Random(f"replace-{self.seed}-{step}-{draw}")
            picked = [self.sources[self._pick(rng.random())] for _ in range(count)]
            return [s.train[rng.randrange(len(s.train))] for s in picked]
        first = (step - 1) * count
        seen, batch = self._seen(first), []
        for i in range(first, first + count):
            source = self._block(i // BLOCK)[i % BLOCK]
            batch.append(self.sources[source].row(seen[source], self.seed))
            seen[source] += 1
        return batch

    def epochs(self, position: int) -> dict[str, float]:
        """Passes made over each source's rows by the first `position` positions."""
        counts = self._seen(position)
        return {s.name: counts[i] / len(s.train) for i, s in enumerate(self.sources)}

    def describe(self) -> str:
        parts = []
        for s in self.sources:
            dropped = sum(s.dropped.values())
            parts.append(
                f"{s.name}: {len(s.train)} training / {len(s.held_out)} held-out prompts, "
                f"weight {s.weight:g}" + (f", {dropped} too long dropped" if dropped else "")
            )
        return "; ".join(parts)

    def summary(self) -> dict:
        """For summary.json: each source's prompt counts, and how many were dropped as too
        long."""
        return {
            "data": {
                s.name: {
                    "train": len(s.train),
                    "held_out": len(s.held_out),
                    "dropped_too_long": s.dropped,
                }
                for s in self.sources
            }
        }

    def _pick(self, u: float) -> int:
        return min(bisect.bisect_right(self.cumulative, u), len(self.sources) - 1)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a few DataPrompts per process at most)
    def _block(self, b: int) -> tuple[int, ...]:
        """The source of each position of block `b`."""
        rng = random.Random(f"mix-{self.seed}-{b}")
        return tuple(self._pick(rng.random()) for _ in range(BLOCK))

    def _seen(self, position: int) -> list[int]:
        """How many of the first `position` positions each source had."""
        b, offset = divmod(position, BLOCK)
        with self._counting:
            while len(self._counts) <= b:  # per-source totals before each block, computed once
                counts = list(self._counts[-1])
                for source in self._block(len(self._counts) - 1):
                    counts[source] += 1
                self._counts.append(counts)
            counts = list(self._counts[b])
        for source in self._block(b)[:offset]:
            counts[source] += 1
        return counts


def make_prompts(config):
    """The prompts of a run: SyntheticPrompts, or data.DataPrompts for name = "data". Prompt
    lengths are counted with the tokenizer at [model] path, which the warm start keeps."""
    task, seed = config.task, config.task.seed + config.loop.seed
    if task.name != "data":
        return SyntheticPrompts(task, seed)
    limit = task.max_prompt_tokens or config.rollout.max_model_len - config.rollout.max_tokens
    return DataPrompts.load(task, str(config.model.path), limit, seed)
