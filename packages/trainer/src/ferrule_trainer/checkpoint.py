"""Checkpoints: the final model in Hugging Face format, and resumable training state.

    save_hf(engine.module, "out/policy", tokenizer_from=model_path)   # transformers / vLLM load it
    save_state(engine, "out/state", step=10, data_position=640)       # everything to resume
    client_state = load_state(engine, "out/state")                    # latest tag by default

Both are collective under ZeRO-3: every rank calls them. `save_hf` streams the exported weights
(export.py: HF names, LoRA merged) to rank 0, which copies each tensor to host memory and writes
the safetensors shards once the stream ends, so rank 0's host memory holds the whole model at
that point. `save_state` is DeepSpeed's own checkpoint (sharded weights, optimizer, scheduler),
plus each rank's RNG states and the caller's step and data position.
"""

import contextlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ferrule_trainer.export import base_model, export_weights

MAX_SHARD_BYTES = 2 * 1024**3
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def save_hf(
    module: torch.nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Writes config.json, generation_config.json, model*.safetensors (+ index when sharded) and
    the tokenizer files found in `tokenizer_from`. `dtype` defaults to the training dtype."""
    from safetensors.torch import save_file

    path = Path(path)
    rank = _rank()
    model = base_model(module)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    out_dtype = None
    for name, tensor in export_weights(module, dtype=dtype):
        out_dtype = tensor.dtype
        if rank != 0:
            continue  # the other ranks only take part in the gathers
        if shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        # safetensors refuses tensors that share storage; a fresh copy on the CPU never does
        shards[-1][name] = tensor.detach().to("cpu", copy=True).contiguous()
        shard_bytes += tensor.nbytes
    if rank == 0:
        _write_shards(path, shards, save_file)
        config = model.config
        if out_dtype is not None:
            config.dtype = out_dtype
        config.save_pretrained(path)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(path)
        if tokenizer_from is not None:
            for filename in _TOKENIZER_FILES:
                if (Path(tokenizer_from) / filename).exists():
                    shutil.copy(Path(tokenizer_from) / filename, path / filename)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_adapter(module: torch.nn.Module, path: str | os.PathLike) -> bool:
    """Saves the LoRA adapter of a peft-wrapped `module` as peft saves it (adapter_config.json,
    adapter_model.safetensors), loadable with `PeftModel.from_pretrained(base, path)`. It is
    collective under ZeRO-3, since the adapter's shards are gathered. Returns False for a model
    without an adapter."""
    if not hasattr(module, "peft_config"):
        return False
    import deepspeed

    adapter = [p for name, p in module.named_parameters() if "lora_" in name]
    with deepspeed.zero.GatheredParameters(adapter):  # a no-op for parameters ZeRO-3 left whole
        if _rank() == 0:
            module.save_pretrained(str(path))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return True


def _write_shards(path: Path, shards: list[dict[str, torch.Tensor]], save_file) -> None:
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata=metadata)
        return
    weight_map = {}
    total = 0
    for index, shard in enumerate(shards, 1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / filename, metadata=metadata)
        for name, tensor in shard.items():
            weight_map[name] = filename
            total += tensor.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _rng_file(directory: Path, tag: str) -> Path:
    return directory / tag / f"rng_state_rank{_rank()}.pt"


@dataclass(frozen=True)
class SavedState:
    """What `save_state` wrote: the checkpoint's tag, and this rank's seconds by part.

    `weights` and `optimizer` time the writes of DeepSpeed's model-states and ZeRO
    optimizer-states files. Without ZeRO the optimizer is inside the model states, so all of
    that time counts as weights. At 1.5B nearly all of a checkpoint is the fp32 master weights
    and Adam moments. `total` is the whole save, including gathering the states, the RNG file
    and the barrier."""

    tag: str
    seconds: dict[str, float]


def save_state(
    engine, directory: str | os.PathLike, *, step: int, **client_state: Any
) -> SavedState:
    """Saves everything needed to continue exactly: DeepSpeed's checkpoint (weights, optimizer,
    lr scheduler) under the tag `step{step}`, this rank's RNG states, and `client_state` (for
    example data_position: how many samples or batches the data loader has handed out).
    The `latest` file in the directory names the tag."""
    began = time.perf_counter()
    directory = Path(directory)
    tag = f"step{step}"
    # Our entries go under one key, because on load DeepSpeed returns its own entries beside ours.
    state = {"ferrule": dict(client_state, step=step)}
    with _timed_writes(engine) as seconds:
        engine.save_checkpoint(str(directory), tag=tag, client_state=state)
    rng = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(rng, _rng_file(directory, tag))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return SavedState(tag, {**seconds, "total": time.perf_counter() - began})


@contextlib.contextmanager
def _timed_writes(engine):
    """Seconds spent in the checkpoint engine's writes (DeepSpeed's pluggable file writer), by
    file: writes of `*optim_states.pt` count as the optimizer's, all other writes as the
    weights'."""
    seconds = {"weights": 0.0, "optimizer": 0.0}
    writer = engine.checkpoint_engine
    save = writer.save

    def timed(state_dict, path, *args, **kwargs):
        began = time.perf_counter()
        try:
            return save(state_dict, path, *args, **kwargs)
        finally:
            part = "optimizer" if str(path).endswith("optim_states.pt") else "weights"
            seconds[part] += time.perf_counter() - began

    writer.save = timed
    try:
        yield seconds
    finally:
        del writer.save  # without the instance attribute, the class's method applies again


def load_state(engine, directory: str | os.PathLike, *, tag: str | None = None) -> dict[str, Any]:
    """Restores a `save_state` checkpoint into `engine` (built with the same model and settings)
    and this rank's RNG; returns the client state (step, data position, ...)."""
    directory = Path(directory)
    if tag is None:
        latest = directory / "latest"
        if not latest.exists():
            raise FileNotFoundError(
                f"{directory}: no 'latest' file; is this a save_state directory?"
            )
        tag = latest.read_text().strip()
    if not (directory / tag).is_dir():
        raise FileNotFoundError(f"{directory}: no checkpoint with tag {tag!r}")
    load_path, client_state = engine.load_checkpoint(str(directory), tag=tag)
    if load_path is None:
        raise RuntimeError(f"{directory / tag}: DeepSpeed could not load this checkpoint")
    rng_file = _rng_file(directory, tag)
    if not rng_file.exists():
        raise FileNotFoundError(f"{rng_file} is missing: saved with a different number of ranks?")
    rng = torch.load(rng_file, weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return client_state["ferrule"]
