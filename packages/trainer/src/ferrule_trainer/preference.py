"""Preference pairs for reward-model training and DPO (rm.py, dpo.py): the [data] table, reading,
tokenizing and batching, and the training loop that both trainers share.

    pairs = load_pairs("pairs.jsonl", config.data)     # {"prompt", "chosen", "rejected"} per line
    batch = pair_batch(tokenizer, pairs[:8], max_length=512, pad_id=0)
    # a batch.SequenceBatch: input_ids (2B, T), the B chosen sequences then the B rejected ones

A sequence is the prompt followed by the response, tokenized as one text without special
tokens (as ferrule-rewards' model backend scores them) and cut to max_length. Its loss_mask
marks the response's tokens, which DPO's log-probabilities sum over. The order of the pairs in
each epoch is seeded by (seed, epoch), so a resumed run continues with the same batches.
"""

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from pydantic import Field

from ferrule_config import InputPath, Table
from ferrule_trainer import engine, nonfinite
from ferrule_trainer.batch import SequenceBatch
from ferrule_trainer.chat import prompt_text
from ferrule_trainer.jsonl import records
from ferrule_trainer.sft import collate, epoch_order, micro_batch_groups


class PreferenceDataConfig(Table):
    """[data]: the preference pairs."""

    path: InputPath
    """JSONL file of training pairs, one object per line (relative to the TOML file)."""
    eval_path: InputPath | None = None
    """JSONL file of held-out pairs, evaluated every [eval] every steps and at the end."""
    prompt_key: str = "prompt"
    """Key of the prompt: a string, or chat messages rendered with the tokenizer's template."""
    chosen_key: str = "chosen"
    """Key of the preferred response (a string)."""
    rejected_key: str = "rejected"
    """Key of the other response (a string)."""
    margin_key: str | None = None
    """Key of a per-pair margin (a number, Llama 2's m(r)), used by reward models only. None:
    no margin."""
    max_length: int = Field(512, ge=2)
    """Prompt + response is cut to this many tokens."""


class PreferenceEvalConfig(Table):
    """[eval]: the held-out pairs of [data] eval_path."""

    every: int = Field(0, ge=0)
    """Evaluate every this many steps (0: only at the end)."""
    batch_size: int = Field(32, ge=1)
    """Pairs per forward pass."""


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0


def load_pairs(path: str | Path, data: PreferenceDataConfig, tokenizer=None) -> list[Pair]:
    """Reads the pairs of a JSONL file. An error names the line and the key that is missing or
    wrong. A prompt may be chat messages, which are rendered with `tokenizer`'s chat template
    (chat.py)."""
    pairs = []
    for number, record in records(path):
        for key in (data.chosen_key, data.rejected_key):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{path}:{number}: needs a string {key!r}")
        if data.prompt_key not in record:
            raise ValueError(f"{path}:{number}: needs a prompt {data.prompt_key!r}")
        margin = record.get(data.margin_key, 0.0) if data.margin_key else 0.0
        if isinstance(margin, bool) or not isinstance(margin, int | float):
            raise ValueError(f"{path}:{number}: {data.margin_key!r} must be a number")
        prompt = prompt_text(tokenizer, record[data.prompt_key], f"{path}:{number}")
        pairs.append(Pair(prompt, record[data.chosen_key], record[data.rejected_key], margin))
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


def _sequence(tokenizer, prompt: str, response: str, max_length: int) -> tuple[list, list]:
    prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer(prompt + response, add_special_tokens=False)["input_ids"][:max_length]
    return ids, [0] * min(prompt_len, len(ids)) + [1] * max(len(ids) - prompt_len, 0)


def pair_batch(tokenizer, pairs: list[Pair], max_length: int, pad_id: int) -> SequenceBatch:
    """Returns the pairs' sequences right-padded, (2B, T), with the chosen sequences first. The
    loss_mask marks the responses, and margin is (B,)."""
    return _collate_pairs([_pair(tokenizer, p, max_length) for p in pairs], pairs, pad_id)


def _pair(tokenizer, pair: Pair, max_length: int) -> tuple[tuple[list, list], ...]:
    return tuple(
        _sequence(tokenizer, pair.prompt, r, max_length) for r in (pair.chosen, pair.rejected)
    )


def _collate_pairs(tokenized: list, pairs: list[Pair], pad_id: int) -> SequenceBatch:
    sequences = [chosen for chosen, _ in tokenized] + [rejected for _, rejected in tokenized]
    margin = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return replace(collate(sequences, pad_id), margin=margin)


def chosen_and_rejected(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (2B,) tensor of a pair batch split into its chosen and rejected halves."""
    half = values.shape[0] // 2
    return values[:half], values[half:]


def total_steps(pairs: int, train) -> int:
    """Optimizer steps of a run over `pairs` pairs as [train] asks (epochs, max_steps)."""
    total = (pairs // train.batch_size) * train.epochs
    return min(total, train.max_steps) if train.max_steps else total


def train_pairs(
    model,
    pairs: list[Pair],
    *,
    tokenizer,
    pad_id: int,
    config,
    pair_loss,
    evaluate,
    log,
) -> list[float]:
    """The training loop of rm.py and dpo.py. Each step takes [train] batch_size pairs in a
    seeded epoch order and splits them over the ranks and into micro-batches.
    `pair_loss(micro_batch, step_pairs)` returns (the micro-batch's share of the step's loss,
    metrics). Resumable state is saved every [output] save_every steps and at the end.
    `evaluate()` returns metrics every [eval] every steps; the callers evaluate at the end.
    Returns each step's loss."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    t, out = config.train, Path(config.output.dir)
    if t.batch_size % (t.micro_batch_size * world):
        raise ValueError(
            f"[train] batch_size {t.batch_size} must be a multiple of micro_batch_size "
            f"{t.micro_batch_size} x {world} ranks"
        )
    steps_per_epoch = len(pairs) // t.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{config.data.path}: {len(pairs)} pairs < batch_size {t.batch_size}")
    total = total_steps(len(pairs), t)
    step = 0
    if config.output.resume and (out / "state" / "latest").exists():
        step = model.load_state(out / "state")["step"]
        log(f"resumed from {out / 'state'} at step {step}")
    losses = []
    skips = nonfinite.SkippedSteps(nonfinite.DEFAULT_LIMIT, "model", "the skips allowed in a row")
    while step < total:
        epoch, index = divmod(step, steps_per_epoch)
        order = epoch_order(len(pairs), t.seed, epoch)
        chosen = [pairs[i] for i in order[index * t.batch_size : (index + 1) * t.batch_size]]
        chosen = chosen[rank::world]
        tokenized = [_pair(tokenizer, p, config.data.max_length) for p in chosen]
        sizes = [(max(len(c), len(r)),) for (c, _), (r, _) in tokenized]
        micro_batches = [
            _collate_pairs([tokenized[i] for i in group], [chosen[i] for i in group], pad_id)
            for group in micro_batch_groups(sizes, t, rows_per_item=2)
        ]
        micro_batches = [mb.to(engine.device()) for mb in micro_batches]

        # weighted so that optimizer_step's average over micro-batches is a mean over the
        # rank's pairs
        share = len(micro_batches) / len(chosen)

        def loss_fn(micro_batch, share=share):
            loss, metrics = pair_loss(micro_batch, t.batch_size)
            weight = micro_batch.pairs * share
            return loss, {key: value * weight for key, value in metrics.items()}

        started = time.perf_counter()
        metrics = engine.optimizer_step(model.engine, micro_batches, loss_fn)
        step += 1
        skips.count(step, metrics)
        where = metrics.pop("nonfinite", "")
        losses.append(metrics["loss"])
        if config.eval.every and step % config.eval.every == 0 and step < total:
            metrics.update(evaluate())
        if rank == 0:
            shown = " ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
            seconds = time.perf_counter() - started
            log(
                f"step {step}/{total} epoch {epoch} {shown} s {seconds:.2f}"
                + (where and f" {where}")
            )
        if config.output.save_every and step % config.output.save_every == 0 and step < total:
            model.save_state(out / "state", step=step)
    model.save_state(out / "state", step=step)
    return losses
