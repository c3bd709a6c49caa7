"""What the actor and the critic share once built: checkpoints, the hybrid engine's offload and
the sequence group they may share each sequence with."""

import os
from typing import Any

import torch

from ferrule_trainer import checkpoint, engine
from ferrule_trainer import sequence_parallel as sp
from ferrule_trainer.engine import startup_seconds as process_startup
from ferrule_trainer.offload import offload_states, reload_states


class TrainedModel:
    """Mixed into a class that sets `engine` (a DeepSpeed engine) and `model_path` (the model
    directory it was loaded from, whose tokenizer goes along with saved models)."""

    engine: Any
    model_path: str
    sequence_group: sp.SequenceGroup | None = None

    @property
    def compiled(self) -> bool:
        """Whether the decoder layers go through torch.compile (compile_layers took effect)."""
        from ferrule_trainer.sequences import compiled_head

        return compiled_head(self.engine)

    def _join_sequence_group(self, size: int, compile_layers: bool) -> None:
        """With `size` > 1: this rank's group of `size` consecutive ranks, which share each
        sequence (sequence_parallel.py); every rank calls it, before the model is built."""
        if size > 1 and compile_layers:
            raise ValueError("sequence_parallel > 1 does not run with compile_layers yet")
        self.sequence_group = sp.SequenceGroup.split(size) if size > 1 else None

    @property
    def _copies(self) -> int:
        """How many ranks hold each of this rank's rows: its sequence group's."""
        return 1 if self.sequence_group is None else self.sequence_group.size

    def _global_sum(self, value) -> torch.Tensor:
        """engine.global_sum over all ranks, each row counted once."""
        return engine.global_sum(value) / self._copies

    def save_hf(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """The model as a Hugging Face directory (LoRA merged), with the tokenizer; with LoRA,
        the adapter itself too, under path/adapter (for `PeftModel.from_pretrained`)."""
        checkpoint.save_hf(self.engine.module, path, dtype=dtype, tokenizer_from=self.model_path)
        checkpoint.save_adapter(self.engine.module, os.path.join(path, "adapter"))

    def save_state(
        self, directory: str | os.PathLike, *, step: int, **client_state: Any
    ) -> checkpoint.SavedState:
        """Resumable training state (weights, optimizer, scheduler, RNG, step, data position);
        returns its tag and this rank's seconds by part."""
        return checkpoint.save_state(self.engine, directory, step=step, **client_state)

    def load_state(self, directory: str | os.PathLike, tag: str | None = None) -> dict[str, Any]:
        """Restores what save_state saved; returns its client state (step, data position, ...)."""
        return checkpoint.load_state(self.engine, directory, tag=tag)

    def startup_seconds(self) -> dict[str, float]:
        """Where this process's start went, seconds by phase (`engine.startup_seconds`: in a
        process that built only this model, its start)."""
        return process_startup()

    def offload(self) -> None:
        """Frees accelerator memory for the rollout engines; see offload.py."""
        offload_states(self.engine)

    def reload(self) -> None:
        """Brings back what `offload` moved to host memory."""
        reload_states(self.engine)

    def release_cache(self) -> None:
        """Gives the allocator's cached blocks back to the GPU: what the last training phase's
        activations reserved (tens of GiB at 1.5B without checkpointing) would otherwise stay
        this process's while the engines sharing the GPU wake and generate. A no-op on CPU."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
