"""What the actor, the critic and the reward model share: how their DeepSpeed engine is built,
checkpoints, the hybrid engine's offload, and the sequence group of ranks that may share each
sequence."""

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ferrule_trainer import checkpoint, engine
from ferrule_trainer import sequence_parallel as sp
from ferrule_trainer.config import LORA_TARGETS
from ferrule_trainer.engine import startup_seconds as process_startup
from ferrule_trainer.offload import offload_states, reload_states


class TrainedModel:
    """Mixed into a class that sets `engine` (a DeepSpeed engine) and `model_path` (the model
    directory it was loaded from; its tokenizer is saved with the model)."""

    engine: Any
    model_path: str
    sequence_group: sp.SequenceGroup | None = None

    def _build(
        self,
        model_path: str | os.PathLike,
        *,
        kind: str = "causal-lm",
        train: bool = True,
        zero_stage: int,
        dtype: str,
        max_grad_norm: float,
        learning_rate: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int,
        total_steps: int | None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        gradient_checkpointing: bool,
        lora_rank: int,
        lora_alpha: int,
        lora_targets: Sequence[str] = LORA_TARGETS,
        attn_implementation: str | None,
        compile_layers: bool = False,
        prepare: Callable[[torch.nn.Module], Any] | None = None,
    ) -> None:
        """Loads the model at `model_path` and wraps it in a DeepSpeed engine (`self.engine`).
        Every trained model takes these steps in this order: build the DeepSpeed config (ZeRO-3
        needs it while loading), load the model (engine.load_model: `kind`, LoRA,
        checkpointing, compiled layers), install the sequence group's attention if there is a
        group, then build the engine with its optimizer and schedule (neither when `train` is
        False)."""
        self.model_path = str(model_path)
        ds_config = engine.deepspeed_config(
            zero_stage=zero_stage,
            dtype=dtype,
            train=train,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            max_grad_norm=max_grad_norm,
        )
        model = engine.load_model(
            model_path,
            kind=kind,
            dtype=dtype,
            ds_config=ds_config,
            gradient_checkpointing=gradient_checkpointing,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
            attn_implementation=attn_implementation,
            compile_layers=compile_layers,
            prepare=prepare,
        )
        if self.sequence_group is not None:
            sp.install(model, self.sequence_group)
        self.engine = engine.build_engine(
            model,
            train=train,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            ds_config=ds_config,
        )

    @property
    def compiled(self) -> bool:
        """Whether the decoder layers go through torch.compile (compile_layers took effect)."""
        from ferrule_trainer.sequences import compiled_head

        return compiled_head(self.engine)

    def _join_sequence_group(self, size: int, compile_layers: bool) -> None:
        """With `size` > 1, joins this rank's group of `size` consecutive ranks, which share
        each sequence (sequence_parallel.py). Every rank calls it, before the model is built."""
        if size > 1 and compile_layers:
            raise ValueError("sequence_parallel > 1 does not run with compile_layers yet")
        self.sequence_group = sp.SequenceGroup.split(size) if size > 1 else None

    @property
    def _copies(self) -> int:
        """How many ranks hold each of this rank's rows: the size of its sequence group (1
        without one)."""
        return 1 if self.sequence_group is None else self.sequence_group.size

    def _global_sum(self, value) -> torch.Tensor:
        """engine.global_sum over all ranks, each row counted once."""
        return engine.global_sum(value) / self._copies

    def save_hf(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Saves the model as a Hugging Face directory (LoRA merged), with the tokenizer. With
        LoRA, the adapter itself is also saved, under path/adapter (for
        `PeftModel.from_pretrained`)."""
        checkpoint.save_hf(self.engine.module, path, dtype=dtype, tokenizer_from=self.model_path)
        checkpoint.save_adapter(self.engine.module, os.path.join(path, "adapter"))

    def save_state(
        self, directory: str | os.PathLike, *, step: int, **client_state: Any
    ) -> checkpoint.SavedState:
        """Saves the resumable training state (weights, optimizer, scheduler, RNG, step, data
        position); returns the checkpoint's tag and this rank's seconds by part."""
        return checkpoint.save_state(self.engine, directory, step=step, **client_state)

    def load_state(self, directory: str | os.PathLike, tag: str | None = None) -> dict[str, Any]:
        """Restores what save_state saved; returns its client state (step, data position, ...)."""
        return checkpoint.load_state(self.engine, directory, tag=tag)

    def startup_seconds(self) -> dict[str, float]:
        """Where this process's startup time went, in seconds by phase
        (`engine.startup_seconds`). In a process that built only this model, that is the
        model's startup."""
        return process_startup()

    def offload(self) -> None:
        """Frees accelerator memory for the rollout engines; see offload.py."""
        offload_states(self.engine)

    def reload(self) -> None:
        """Brings back what `offload` moved to host memory."""
        reload_states(self.engine)

    def release_cache(self) -> None:
        """Gives the allocator's cached blocks back to the GPU. Otherwise the memory that the
        last training phase's activations reserved (tens of GiB at 1.5B without checkpointing)
        would stay with this process while the engines sharing the GPU wake and generate. A
        no-op on CPU."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
