"""The policy being trained (actor) and the frozen reference policy, as DeepSpeed engines.

    actor = Actor(model_path, zero_stage=2, dtype="bfloat16", learning_rate=1e-6, lora_rank=0)
    reference = Actor(model_path, train=False, zero_stage=3)
    batch = batch.replace(ref_logprobs=reference.logprobs(batch))   # a Batch (batch.py)
    metrics = actor.train_step(micro_batches, PolicyLoss(clip_low=0.2, kl_coef=0.001))
    plan = EpochPlan(epochs=2, mini_batches=4, micro_batch_size=8)   # settings.py
    metrics = actor.train_epochs(batch, plan, PolicyLoss())
    by_tokens = EpochPlan(micro_batch_size=64, micro_batch_tokens=8192, pack_sequences=True)
    metrics = actor.likelihood_epochs(batch, plan)                                    # SFT
    metrics = actor.preference_epochs(pairs, plan, PreferenceLoss(beta=0.1))           # DPO
    sender.send(actor.export_weights(dtype=torch.bfloat16), specs=actor.weight_specs(torch.bfloat16))
    actor.save_hf("out/policy"); actor.save_state("out/state", step=10, data_position=640)

Every rank of the data-parallel group calls every method with its own share of the batch (the
exports and checkpoints gather under ZeRO-3, so all ranks take part; only rank 0 writes files).
"""

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ferrule_trainer import engine, export
from ferrule_trainer import sequence_parallel as sp
from ferrule_trainer.aggregation import aggregate_loss, masked_sum, sequences_with_tokens
from ferrule_trainer.batch import Batch
from ferrule_trainer.config import LORA_TARGETS
from ferrule_trainer.kl import kl_estimate, kl_loss
from ferrule_trainer.losses import entropy_bonus, policy_loss
from ferrule_trainer.pairwise import dpo_loss
from ferrule_trainer.rl import ppo_epochs
from ferrule_trainer.sequences import forward_in_micro_batches, response_logprobs
from ferrule_trainer.settings import EpochPlan, ForwardPlan, PolicyLoss, PreferenceLoss
from ferrule_trainer.trained import TrainedModel


class Actor(TrainedModel):
    """A causal LM under DeepSpeed: PPO-family train steps, log-probs, weight export, checkpoints.

    train=False builds the reference policy: no optimizer, ZeRO-3 sharding if zero_stage is 3,
    a full copy per rank otherwise. temperature is the rollout's sampling temperature: log-probs
    are computed under softmax(logits / temperature), as the sampler drew the tokens.
    compile_layers runs the decoder layers through torch.compile (CUDA, ZeRO 0-2; see
    engine.compile_decoder_layers). sequence_parallel is the number of ranks that share each
    sequence (sequence_parallel.py); consecutive ranks form a group and are given the same rows.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        train: bool = True,
        zero_stage: int = 2,
        dtype: str = "bfloat16",
        learning_rate: float = 1e-6,
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
        lora_targets: Sequence[str] = LORA_TARGETS,
        temperature: float = 1.0,
        attn_implementation: str | None = None,
        compile_layers: bool = False,
        seed: int = 0,
        prepare_model: Callable[[torch.nn.Module], Any] | None = None,
        sequence_parallel: int = 1,
    ):
        engine.init_distributed()
        self._join_sequence_group(sequence_parallel, compile_layers)
        torch.manual_seed(seed)  # LoRA initialisation is random: the same on every rank
        self.temperature = temperature
        self.train = train
        self._build(
            model_path,
            train=train,
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
            gradient_checkpointing=gradient_checkpointing and train,
            lora_rank=lora_rank if train else 0,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
            attn_implementation=attn_implementation,
            compile_layers=compile_layers,
            prepare=prepare_model,
        )
        self._exports: dict[torch.dtype | None, export.WeightExport] = {}

    @property
    def module(self) -> torch.nn.Module:
        """The model inside the engine (a peft model when LoRA is on)."""
        return self.engine.module

    @property
    def device(self) -> torch.device:
        """Where this rank's model lives (and its batches are moved to)."""
        return engine.device()

    @torch.no_grad()
    def logprobs(
        self,
        batch: Batch,
        plan: ForwardPlan = ForwardPlan(),
        temperature: float | None = None,
    ) -> torch.Tensor:
        """(B, R) log-probabilities of the response tokens (the reference's or the old policy's),
        on the host, 0 on padding. The forward passes follow `plan`: how many rows and tokens at
        a time, and whether packed (see sequences.forward_in_micro_batches). `temperature` is
        the softmax's: None uses the rollout's, as the sampler drew the tokens, and 1.0 gives
        the model's own distribution, which is what DPO compares."""
        was_training = self.engine.training
        self.engine.eval()
        temperature = self.temperature if temperature is None else temperature

        def forward(micro_batch):
            return self._response_logprobs(micro_batch, temperature, packed=plan.packed)[0]

        try:
            return forward_in_micro_batches(
                forward,
                batch,
                plan.micro_batch_size,
                self.device,
                plan.micro_batch_tokens,
                plan.packed,
                lockstep=self.engine.zero_optimization_stage() == 3,
            )
        finally:
            self.engine.train(was_training)

    def warm_up(
        self, tokens: int, packed: bool = False, entropy: bool = False, score: bool = True
    ) -> float:
        """Runs the passes of a step on a made-up batch of two rows of `tokens` / 2 tokens each
        (the step's micro-batch size; see below). Layers compiled on their first call
        (compile_layers) then compile now, while the caller has other work, rather than in the
        first step. With `score`, it runs the scoring pass (`logprobs`). On a trained model it
        runs the training forward (`packed` and `entropy` as in the step) and its backward
        through every layer.

        Nothing that the step uses changes. The backward is `torch.autograd.grad` to one
        parameter of the first layer, which puts no gradient in any `.grad` (DeepSpeed's
        reduction hooks run only where a gradient accumulates), and no optimizer state moves.
        Inductor specialises a layer's graph on whether its tokens x hidden size is small
        (measured at 1.5B: below 5,242,880 elements, ~3.4k tokens), and the LM head's graph on
        being a chunk of a longer row. So the made-up batch has the micro-batch's size (at a
        real budget of thousands of tokens, that is more than one head chunk of response).
        Returns the seconds it took."""
        import time

        began = time.perf_counter()
        if self.sequence_group is not None:  # no compiled layers (see _join_sequence_group)
            return 0.0
        length = max(64, tokens // 2)
        vocab = self.module.get_output_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
        attention = torch.ones_like(ids)
        attention[1, :8] = 0  # a shorter prompt, as in a step
        batch = Batch(ids, attention, torch.ones(2, length * 3 // 4, dtype=torch.long))
        if score:
            self.logprobs(batch, ForwardPlan(packed=packed))
        if self.train:
            embeddings = {
                id(self.module.get_input_embeddings().weight),
                id(self.module.get_output_embeddings().weight),
            }
            first = next(
                p for p in self.module.parameters() if p.requires_grad and id(p) not in embeddings
            )
            self.engine.train()
            logprobs, entropies = response_logprobs(
                self.module, batch.to(self.device), self.temperature, packed=packed,
                entropy=entropy,
            )  # fmt: skip
            total = logprobs.sum() + (entropies.sum() if entropy else 0.0)
            torch.autograd.grad(total, [first], allow_unused=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    def train_step(
        self,
        micro_batches: Sequence[Batch],
        loss: PolicyLoss = PolicyLoss(),
        packed: bool = False,
    ) -> dict[str, float]:
        """One optimizer step of the PPO clipped loss over this rank's micro-batches; `loss`
        holds the loss's settings. With `packed`, each forward packs its micro-batch's rows
        without padding (`sequences.packed_inputs`).

        Each micro-batch (a Batch) holds old_logprobs and advantages, ref_logprobs when
        kl_coef > 0, and optionally is_weights (rollout / trainer importance weights). The loss
        is aggregated over the valid tokens (or sequences) of the whole step on all ranks, so the
        split into micro-batches and ranks does not change the gradient.

        Without old_logprobs the step is on-policy. It is then the batch's only optimizer step,
        so this forward runs at the same weights that would have computed old_logprobs, and its
        own log-probabilities (detached) serve as the old ones, with no separate forward pass.
        The step then also reports, over all ranks, what the caller would have computed from
        old_logprobs: "vllm_kl" (k3 of the engine's rollout_logprobs, when given) and "kl" (k1
        to ref_logprobs, when given).
        """
        if not self.train:
            raise RuntimeError("train_step on a frozen Actor (train=False, e.g. the reference)")
        on_policy = micro_batches[0].old_logprobs is None
        required = ["advantages"] + ([] if on_policy else ["old_logprobs"])
        required += ["ref_logprobs"] if loss.kl_coef else []
        for micro_batch in micro_batches:
            micro_batch.require(*required)
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        own_tokens = sum(int(mb.response_mask.sum()) for mb in micro_batches)
        tokens = self._global_sum(own_tokens)
        sequences = self._global_sum(
            sum(sequences_with_tokens(mb.response_mask) for mb in micro_batches)
        )
        counts = dict(agg_mode=loss.agg_mode, num_tokens=tokens, num_sequences=sequences)

        def loss_fn(micro_batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
            mask = micro_batch.response_mask
            logprobs, entropy = self._response_logprobs(
                micro_batch,
                self.temperature,
                packed=packed,
                entropy=loss.entropy_coef > 0,
            )
            old = logprobs.detach() if on_policy else micro_batch.old_logprobs
            pg = policy_loss(
                logprobs,
                old,
                micro_batch.advantages,
                mask,
                clip_low=loss.clip_low,
                clip_high=loss.clip_high,
                dual_clip=loss.dual_clip,
                is_weights=micro_batch.is_weights,
                ratio_level=loss.ratio_level,
                **counts,
            )
            total = pg.loss
            # token means over this rank's step (optimizer_step averages over micro-batches)
            weight = mask.sum() * len(micro_batches) / max(own_tokens, 1)
            metrics = {
                "clip_fraction": pg.clip_fraction * weight,
                "approx_kl": pg.approx_kl * weight,
            }
            if on_policy:  # this rank's token sums / the step's global count; ranks summed below
                share = len(micro_batches) / tokens
                if micro_batch.rollout_logprobs is not None:
                    k3 = kl_estimate(micro_batch.rollout_logprobs, old, mask, kind="k3")
                    metrics["vllm_kl"] = masked_sum(k3, mask) * share
                if micro_batch.ref_logprobs is not None:
                    k1 = kl_estimate(old, micro_batch.ref_logprobs, mask, kind="k1")
                    metrics["kl"] = masked_sum(k1, mask) * share
            if loss.kl_coef:
                kl = kl_loss(
                    logprobs,
                    micro_batch.ref_logprobs,
                    mask,
                    kind=loss.kl_kind,
                    max_abs_estimate=loss.kl_max,
                    **counts,
                )
                total = total + loss.kl_coef * kl
            if loss.entropy_coef:
                total = total - loss.entropy_coef * entropy_bonus(entropy, mask, **counts)
            return total, metrics

        metrics = engine.optimizer_step(self.engine, micro_batches, loss_fn, self._copies)
        for key in ("vllm_kl", "kl"):  # global means: the sum of every rank's share
            if key in metrics:
                metrics[key] = float(self._global_sum(metrics[key]))
        metrics["tokens"] = float(tokens)
        return metrics

    def likelihood_epochs(self, batch: Batch, plan: EpochPlan) -> dict[str, float]:
        """SFT on chosen samples (rejection sampling): `rl.ppo_epochs` of `likelihood_step` over
        this rank's share of the batch."""
        return ppo_epochs(self.likelihood_step, batch, plan)

    def likelihood_step(
        self, micro_batches: Sequence[Batch], packed: bool = False
    ) -> dict[str, float]:
        """One optimizer step of the responses' negative log-likelihood, the mean over the valid
        response tokens of the step on all ranks."""
        micro_batches = self._on_device(micro_batches)
        tokens = self._global_sum(sum(int(mb.response_mask.sum()) for mb in micro_batches))

        def loss_fn(micro_batch):
            logprobs, _ = self._response_logprobs(micro_batch, packed=packed)
            nll = aggregate_loss(-logprobs, micro_batch.response_mask, num_tokens=tokens)
            return nll, {}

        return engine.optimizer_step(self.engine, micro_batches, loss_fn, self._copies)

    def preference_epochs(
        self, batch: Batch, plan: EpochPlan, loss: PreferenceLoss
    ) -> dict[str, float]:
        """DPO on preference pairs (iterative DPO): `rl.ppo_epochs` of `preference_step`, with
        mini- and micro-batches cut at whole pairs. `batch` is this rank's share. Each pair's
        chosen response is in an even row and its rejected response in the next row. `batch`
        also holds ref_logprobs: the frozen reference's log-probabilities at temperature 1."""
        rows = batch.rows
        if rows % 2:
            raise ValueError(f"preference pairs take two rows each, got {rows} rows")

        def step(micro_batches: list[Batch], packed: bool) -> dict[str, float]:
            return self.preference_step(micro_batches, loss, packed)

        return ppo_epochs(step, batch, plan, unit=2)

    def preference_step(
        self,
        micro_batches: Sequence[Batch],
        loss: PreferenceLoss,
        packed: bool = False,
    ) -> dict[str, float]:
        """One optimizer step of DPO (pairwise.dpo_loss, with `loss` as its settings) over the
        pairs of `micro_batches` (laid out as in preference_epochs). The loss is the mean over
        the step's pairs on all ranks. loss.nll_coef > 0 adds the chosen responses' mean NLL per
        token (RPO), which keeps DPO from lowering the chosen responses' own likelihood."""
        kind = loss.kind
        for micro_batch in micro_batches:
            micro_batch.require("ref_logprobs")
        micro_batches = self._on_device(micro_batches)
        own_pairs = sum(mb.rows // 2 for mb in micro_batches)
        pairs = self._global_sum(own_pairs)

        def loss_fn(micro_batch):
            mask = micro_batch.response_mask.float()
            logprobs, _ = self._response_logprobs(micro_batch, packed=packed)
            lengths = mask.sum(-1).clamp(min=1)
            sums = (logprobs * mask).sum(-1)
            ref = (micro_batch.ref_logprobs.float() * mask).sum(-1)
            chosen_nll = -(sums[0::2] / lengths[0::2])
            if kind == "ipo":  # IPO compares length-averaged log-probabilities
                sums, ref = sums / lengths, ref / lengths
            out = dpo_loss(
                sums[0::2], sums[1::2], ref[0::2], ref[1::2],
                beta=loss.beta, kind=kind, label_smoothing=loss.label_smoothing,
            )  # fmt: skip
            # means over this rank's pairs (optimizer_step averages over micro-batches)
            share = len(micro_batches) / own_pairs
            metrics = {
                "accuracy": out.correct.float().sum() * share,
                "margin": (out.chosen_reward - out.rejected_reward).sum() * share,
                "chosen_nll": chosen_nll.detach().sum() * share,
            }
            return (out.loss + loss.nll_coef * chosen_nll).sum() / pairs, metrics

        return engine.optimizer_step(self.engine, micro_batches, loss_fn, self._copies)

    def _response_logprobs(
        self, micro_batch: Batch, temperature: float = 1.0, packed: bool = False, entropy=False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """sequences.response_logprobs of the engine, or sp.response_logprobs when this rank
        is in a sequence group."""
        if self.sequence_group is None:
            return response_logprobs(
                self.engine, micro_batch, temperature, packed=packed, entropy=entropy
            )
        return sp.response_logprobs(
            self.engine, micro_batch, temperature, self.sequence_group, packed=packed,
            entropy=entropy,
        )  # fmt: skip

    def _on_device(self, micro_batches: Sequence[Batch]) -> list[Batch]:
        if not self.train:
            raise RuntimeError("a train step on a frozen Actor (train=False, e.g. the reference)")
        return [mb.to(self.device) for mb in micro_batches]

    def train_epochs(self, batch: Batch, plan: EpochPlan, loss: PolicyLoss) -> dict[str, float]:
        """PPO epochs (`rl.ppo_epochs`, as `plan` says) of `train_step` with `loss` over this
        rank's share of one rollout batch. A batch without old_logprobs must take exactly one
        optimizer step (see train_step)."""
        if batch.old_logprobs is None and plan.updates != 1:
            raise ValueError(
                f"a batch without old_logprobs is trained on-policy, in one optimizer step; "
                f"epochs x mini_batches = {plan.updates}"
            )

        def step(micro_batches: list[Batch], packed: bool) -> dict[str, float]:
            return self.train_step(micro_batches, loss, packed)

        return ppo_epochs(step, batch, plan)

    def weight_specs(self, dtype: torch.dtype | None = None):
        """The names, shapes and dtypes `export_weights` will yield, without gathering anything."""
        return self._export(dtype).specs()

    def weights_digest(self, dtype: torch.dtype | None = None) -> str:
        """`ferrule_weightsync.digest` of `export_weights(dtype)`. An engine that loaded every
        tensor of the last sync as sent reports the same digest. Every rank must call it, since
        ZeRO-3 gathers."""
        from ferrule_weightsync import digest

        return digest(self.export_weights(dtype))

    def export_weights(
        self, dtype: torch.dtype | None = None, bucket_bytes: int = export.DEFAULT_BUCKET_BYTES
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The full weights as (Hugging Face name, tensor), LoRA merged; see export.py."""
        return self._export(dtype).weights(bucket_bytes)

    def export_in_place(self, dtype: torch.dtype | None = None) -> bool:
        """Whether `export_weights(dtype)` yields this rank's own parameter memory, with nothing
        gathered, cast or merged. If so, a CUDA IPC sender may let engines read that memory
        where it lies."""
        return self._export(dtype).in_place

    def take_part_in_export(
        self, dtype: torch.dtype | None = None, bucket_bytes: int = export.DEFAULT_BUCKET_BYTES
    ) -> None:
        """On a rank that sends nothing: joins the ZeRO-3 gathers of the ranks that call
        `export_weights` (same arguments), keeping nothing; a no-op without ZeRO-3."""
        self._export(dtype).take_part(bucket_bytes)

    def _export(self, dtype: torch.dtype | None) -> export.WeightExport:
        # built once per dtype; a sync after every step would otherwise redo it each time
        if dtype not in self._exports:
            self._exports[dtype] = export.WeightExport(self.module, dtype)
        return self._exports[dtype]
