"""Supervised fine-tuning on JSONL prompt/response pairs: `rlhf-train sft config.toml`.

    [model]
    path = "models/base"            # a Hugging Face model directory (paths: relative to this file)
    [data]
    path = "data/train.jsonl"       # {"prompt": "...", "response": "..."} per line
    [train]
    batch_size = 32
    [output]
    dir = "out/sft"                 # out/sft/model: the result; out/sft/state: resumable state

The loss is the cross-entropy of the response tokens (and of the end-of-sequence token that
closes them), averaged over all response tokens of the optimizer step on all ranks. Each epoch's
shuffle is seeded by (seed, epoch). A restart with `resume = true` continues from the last saved
state (weights, optimizer, scheduler, RNG and data position) and gives the same losses as a run
that was never interrupted. To run on more processes, use any launcher that sets RANK /
WORLD_SIZE.
"""

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field

from ferrule_config import InputPath, Table
from ferrule_trainer import engine, nonfinite
from ferrule_trainer.aggregation import aggregate_loss
from ferrule_trainer.batch import SequenceBatch
from ferrule_trainer.chat import prompt_text
from ferrule_trainer.config import ModelConfig, TrainDType
from ferrule_trainer.jsonl import records
from ferrule_trainer.sequences import group_by_length, model_forward


class SFTModelConfig(ModelConfig):
    """[model] of `rlhf-train sft`, `rm` and `dpo`: the model, and how DeepSpeed holds and
    trains it."""

    dtype: TrainDType = "bfloat16"
    """"bfloat16" or "float32" (use float32 on CPUs without bf16 instructions)."""
    zero_stage: int = Field(2, ge=0, le=3)
    """DeepSpeed ZeRO stage 0-3."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about a third more compute."""
    lora_rank: int = Field(0, ge=0)
    """Above 0, train LoRA adapters of this rank instead of all weights. The adapters are merged
    into the saved model."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scale numerator: the update is B A * lora_alpha / lora_rank."""


class SFTDataConfig(Table):
    """[data]: the examples."""

    path: InputPath
    """JSONL file, one object per line with a prompt (a string, or chat messages rendered with
    the tokenizer's chat template) and a response string (relative to the TOML file)."""
    prompt_key: str = "prompt"
    """Key of the prompt in each line."""
    response_key: str = "response"
    """Key of the response in each line."""
    max_length: int = Field(512, ge=2)
    """Sequences (prompt + response + end token) are cut to this many tokens."""


class SFTTrainConfig(Table):
    """[train]: the optimisation."""

    epochs: int = Field(1, ge=1)
    """Passes over the data; the last partial batch of an epoch is dropped."""
    batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step over all ranks."""
    micro_batch_size: int = Field(8, ge=1)
    """The most sequences (for rm and dpo: pairs) per forward/backward on one rank."""
    micro_batch_tokens: int | None = Field(8192, ge=1)
    """The most tokens (rows x padded length) per forward/backward on one rank. Each rank sorts
    its share of a step by length into micro-batches within this budget, each of up to
    micro_batch_size sequences (or pairs). A sequence (or pair) longer than this goes alone. The
    loss is the same however the step is split. "none": micro_batch_size per micro-batch, in
    data order."""
    learning_rate: float = Field(1e-5, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps, then cosine decay to a tenth of the peak."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps in all (0: train every epoch to the end)."""
    seed: int = 0
    """Shuffling and initialisation seed."""


class SFTOutputConfig(Table):
    """[output]: where results go."""

    dir: Path = Path("out/sft")
    """Where the model (dir/model) and the resumable state (dir/state) go (relative to the
    current directory)."""
    save_every: int = Field(0, ge=0)
    """Save resumable state every this many steps (0: only at the end)."""
    resume: bool = True
    """Continue from dir/state when it holds a saved state."""


class SFTConfig(Table):
    """A `rlhf-train sft` run: one TOML file with these tables."""

    model: SFTModelConfig
    data: SFTDataConfig
    train: SFTTrainConfig = SFTTrainConfig()
    output: SFTOutputConfig = SFTOutputConfig()


def load_examples(
    path: str | Path, prompt_key: str, response_key: str, tokenizer=None
) -> list[tuple[str, str]]:
    """Reads (prompt, response) pairs. An error names the line that lacks a key or is not JSON.
    A prompt may be chat messages, which are rendered with `tokenizer`'s chat template
    (chat.py)."""
    examples = []
    for number, record in records(path):
        if not isinstance(record.get(response_key), str) or prompt_key not in record:
            key = prompt_key if prompt_key not in record else response_key
            raise ValueError(f"{path}:{number}: needs a string {key!r}, got {record!r:.200}")
        prompt = prompt_text(tokenizer, record[prompt_key], f"{path}:{number}")
        examples.append((prompt, record[response_key]))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def tokenize(tokenizer, prompt: str, response: str, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response + eos and the loss mask (1 on response and eos)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    response_ids = [*response_ids, tokenizer.eos_token_id]
    ids = (prompt_ids + response_ids)[:max_length]
    mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_length]
    return ids, mask


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> SequenceBatch:
    """The examples' (ids, loss mask) right-padded into one batch, (B, T) each."""
    length = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (tokens, mask) in enumerate(examples):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        loss_mask[row, : len(tokens)] = torch.tensor(mask)
    return SequenceBatch(ids, attention, loss_mask)


def micro_batch_groups(
    sizes: list[tuple[int, ...]], train: SFTTrainConfig, rows_per_item: int = 1
) -> list[list[int]]:
    """Splits a rank's share of a step into micro-batches, each a list of item indices. An item
    is a sequence, or for rm and dpo a pair of `rows_per_item` rows. With [train]
    micro_batch_tokens, `sequences.group_by_length` groups the items by their `sizes`;
    otherwise the items are cut into runs of micro_batch_size, in order."""
    size = train.micro_batch_size
    if train.micro_batch_tokens is None:
        return [list(range(i, min(i + size, len(sizes)))) for i in range(0, len(sizes), size)]
    return group_by_length(
        sizes, max_items=size, max_tokens=train.micro_batch_tokens, rows_per_item=rows_per_item
    )


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def sft_loss(model, batch: SequenceBatch, num_tokens: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's token-mean cross-entropy."""
    logits = model_forward(model, dict(input_ids=batch.input_ids)).logits  # see SequenceBatch
    targets = batch.input_ids[:, 1:]
    mask = batch.loss_mask[:, 1:]
    per_token = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none"
    )
    return aggregate_loss(per_token.view(targets.shape), mask, num_tokens=num_tokens)


def train(config: SFTConfig, log=print) -> list[float]:
    """Runs SFT as configured; returns the loss of every step this run took."""
    from transformers import AutoTokenizer

    from ferrule_trainer.actor import Actor

    engine.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg_t, out = config.train, Path(config.output.dir)
    if cfg_t.batch_size % (cfg_t.micro_batch_size * world):
        raise ValueError(
            f"[train] batch_size {cfg_t.batch_size} must be a multiple of micro_batch_size "
            f"{cfg_t.micro_batch_size} x {world} ranks"
        )
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    examples = load_examples(
        config.data.path, config.data.prompt_key, config.data.response_key, tokenizer
    )
    steps_per_epoch = len(examples) // cfg_t.batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"{config.data.path}: {len(examples)} examples < batch_size {cfg_t.batch_size}"
        )
    total_steps = steps_per_epoch * cfg_t.epochs
    if cfg_t.max_steps:
        total_steps = min(total_steps, cfg_t.max_steps)
    actor = Actor(
        config.model.path,
        zero_stage=config.model.zero_stage,
        dtype=config.model.dtype,
        learning_rate=cfg_t.learning_rate,
        weight_decay=cfg_t.weight_decay,
        max_grad_norm=cfg_t.max_grad_norm,
        warmup_steps=cfg_t.warmup_steps,
        total_steps=total_steps,
        gradient_checkpointing=config.model.gradient_checkpointing,
        lora_rank=config.model.lora_rank,
        lora_alpha=config.model.lora_alpha,
        attn_implementation=config.model.attn_implementation,
        seed=cfg_t.seed,
    )
    step = 0
    if config.output.resume and (out / "state" / "latest").exists():
        step = actor.load_state(out / "state")["step"]
        log(f"resumed from {out / 'state'} at step {step}")
    device = engine.device()
    losses = []
    skips = nonfinite.SkippedSteps(nonfinite.DEFAULT_LIMIT, "model", "the skips allowed in a row")
    while step < total_steps:
        epoch, index = divmod(step, steps_per_epoch)  # the data position follows from the step
        order = epoch_order(len(examples), cfg_t.seed, epoch)
        chosen = order[index * cfg_t.batch_size : (index + 1) * cfg_t.batch_size][rank::world]
        tokenized = [tokenize(tokenizer, *examples[i], config.data.max_length) for i in chosen]
        micro_batches = [
            collate([tokenized[i] for i in group], pad_id).to(device)
            for group in micro_batch_groups([(len(ids),) for ids, _ in tokenized], cfg_t)
        ]
        tokens = engine.global_sum(sum(int(mb.loss_mask[:, 1:].sum()) for mb in micro_batches))
        start = time.perf_counter()
        metrics = engine.optimizer_step(
            actor.engine,
            micro_batches,
            lambda mb, tokens=tokens: (sft_loss(actor.engine, mb, tokens), {}),
        )
        step += 1
        skips.count(step, metrics)
        losses.append(metrics["loss"])
        if rank == 0:
            speed = float(tokens) / (time.perf_counter() - start)
            log(
                f"step {step}/{total_steps} epoch {epoch} loss {metrics['loss']:.4f} "
                f"lr {metrics['lr']:.2e} grad_norm {metrics['grad_norm']:.3f} tokens/s {speed:.0f}"
                + (f" skipped: {metrics['nonfinite']}" if metrics["skipped"] else "")
            )
        if config.output.save_every and step % config.output.save_every == 0 and step < total_steps:
            actor.save_state(out / "state", step=step, data_position=step * cfg_t.batch_size)
    actor.save_state(out / "state", step=step, data_position=step * cfg_t.batch_size)
    actor.save_hf(out / "model")
    if rank == 0:
        log(f"saved {out / 'model'}")
    return losses
