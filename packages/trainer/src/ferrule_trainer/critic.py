"""The PPO critic (a trained value model) under DeepSpeed.

    critic = Critic(model_path, zero_stage=2, dtype="bfloat16", learning_rate=5e-6)
    batch = batch.replace(old_values=critic.values(batch))          # a Batch (batch.py)
    metrics = critic.train_step(micro_batches, ValueLoss(clip=0.2))    # needs returns too
    metrics = critic.train_epochs(batch, EpochPlan(epochs=2, mini_batches=4), ValueLoss())

The critic is the policy's architecture with a linear value head on the last hidden state
(`AutoModelForTokenClassification`, one label). Started from a causal LM checkpoint, the critic
gets a new head. Started from a saved critic, it keeps the trained head. Started from a reward
model (`rlhf-train rm`; the launcher's `[critic] init = "reward_model"`), it takes that model's
body and scalar head. Reward models are trained by rm.py and served by ferrule-rewards (its
`model` backend); they are not run here.
"""

import os
from collections.abc import Sequence
from typing import Any

import torch

from ferrule_trainer import engine
from ferrule_trainer import sequence_parallel as sp
from ferrule_trainer.aggregation import sequences_with_tokens
from ferrule_trainer.batch import Batch
from ferrule_trainer.losses import value_loss
from ferrule_trainer.rl import ppo_epochs
from ferrule_trainer.sequences import forward_in_micro_batches, response_values
from ferrule_trainer.settings import EpochPlan, ForwardPlan, ValueLoss
from ferrule_trainer.trained import TrainedModel


class Critic(TrainedModel):
    """Computes values per response token and takes train steps of the clipped value loss (see
    losses.value_loss). `sequence_parallel` is the number of ranks that share each sequence, as
    in `Actor`."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        zero_stage: int = 2,
        dtype: str = "bfloat16",
        learning_rate: float = 5e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        max_grad_norm: float = 1.0,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        gradient_checkpointing: bool = False,
        lora_rank: int = 0,
        lora_alpha: int = 16,
        attn_implementation: str | None = None,
        compile_layers: bool = False,
        seed: int = 0,
        sequence_parallel: int = 1,
    ):
        engine.init_distributed()
        self._join_sequence_group(sequence_parallel, compile_layers)
        torch.manual_seed(seed)  # the new value head starts the same on every rank
        self._build(
            model_path,
            kind="value",
            zero_stage=zero_stage,
            dtype=dtype,
            max_grad_norm=max_grad_norm,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            gradient_checkpointing=gradient_checkpointing,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            attn_implementation=attn_implementation,
            compile_layers=compile_layers,
        )

    @torch.no_grad()
    def values(
        self,
        batch: Batch,
        plan: ForwardPlan = ForwardPlan(),
    ) -> torch.Tensor:
        """Returns the (B, R) values of the states before each response token, on the host. The
        forward passes follow `plan`, as in `Actor.logprobs`."""
        self.engine.eval()
        try:
            return forward_in_micro_batches(
                lambda mb: self._values(mb, plan.packed),
                batch,
                plan.micro_batch_size,
                engine.device(),
                plan.micro_batch_tokens,
                plan.packed,
                lockstep=self.engine.zero_optimization_stage() == 3,
            )
        finally:
            self.engine.train()

    def train_step(
        self,
        micro_batches: Sequence[Batch],
        loss: ValueLoss = ValueLoss(),
        packed: bool = False,
    ) -> dict[str, float]:
        """Takes one optimizer step of the clipped value loss with the settings in `loss`. The
        micro-batches must carry old_values and returns. `packed` works as in
        `Actor.train_step`."""
        for micro_batch in micro_batches:
            micro_batch.require("old_values", "returns")
        micro_batches = [mb.to(engine.device()) for mb in micro_batches]
        own_tokens = sum(int(mb.response_mask.sum()) for mb in micro_batches)
        tokens = self._global_sum(own_tokens)
        sequences = self._global_sum(
            sum(sequences_with_tokens(mb.response_mask) for mb in micro_batches)
        )

        def loss_fn(micro_batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
            values = self._values(micro_batch, packed)
            result = value_loss(
                values,
                micro_batch.old_values,
                micro_batch.returns,
                micro_batch.response_mask,
                clip=loss.clip,
                agg_mode=loss.agg_mode,
                num_tokens=tokens,
                num_sequences=sequences,
            )
            # weighted so that optimizer_step's average over micro-batches is a token mean over
            # this rank's step
            weight = micro_batch.response_mask.sum() * len(micro_batches) / max(own_tokens, 1)
            return result.loss, {"value_clip_fraction": result.clip_fraction * weight}

        return engine.optimizer_step(self.engine, micro_batches, loss_fn, self._copies)

    def _values(self, micro_batch: Batch, packed: bool) -> torch.Tensor:
        """sequences.response_values of the engine, or its sequence-parallel form."""
        if self.sequence_group is None:
            return response_values(self.engine, micro_batch, packed)
        return sp.response_values(self.engine, micro_batch, self.sequence_group, packed=packed)

    def train_epochs(self, batch: Batch, plan: EpochPlan, loss: ValueLoss) -> dict[str, float]:
        """Runs PPO epochs of `train_step` with `loss` (`rl.ppo_epochs`, as `plan` says) over
        this rank's share of one rollout batch."""

        def step(micro_batches: list[Batch], packed: bool) -> dict[str, float]:
            return self.train_step(micro_batches, loss, packed)

        return ppo_epochs(step, batch, plan)
