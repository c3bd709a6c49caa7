"""The settings that the training verbs take. Each is a frozen dataclass, passed whole from the
RL step to the rank that uses it (through Ray when the ranks are remote), so a renamed field
fails where the settings are built, not on a remote actor:

    plan, loss = trainer.epoch_plan(), trainer.policy_loss()    # TrainerConfig builds them
    metrics = actor.train_epochs(batch, plan, loss)
    old = actor.logprobs(batch, trainer.forward_plan())

Neither torch nor pydantic is imported here.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class EpochPlan:
    """How one batch is trained (`rl.ppo_epochs`): `epochs` passes over the batch, with
    `mini_batches` optimizer steps per pass. Each step runs in micro-batches of at most
    `micro_batch_size` rows (None: the whole mini-batch). With `micro_batch_tokens`, rows are
    sorted by length into micro-batches of at most that many tokens each. With
    `pack_sequences`, each micro-batch is one row without padding."""

    epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    pack_sequences: bool = False

    @property
    def updates(self) -> int:
        """Optimizer steps per batch."""
        return self.epochs * self.mini_batches


@dataclass(frozen=True)
class ForwardPlan:
    """How a batch goes through a forward pass without gradients (`Actor.logprobs`,
    `Critic.values`): `micro_batch_size` rows at a time (None: all rows). With
    `micro_batch_tokens`, rows are sorted by length into micro-batches of at most that many
    tokens each. With `packed`, micro-batches have no padding."""

    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    packed: bool = False


@dataclass(frozen=True)
class PolicyLoss:
    """Settings of the clipped policy loss of `Actor.train_step` (losses.policy_loss): the
    ratio's clip range [1 - clip_low, 1 + clip_high], the dual clip for negative advantages
    (None: off), how token losses aggregate, the KL penalty in the loss (kl_coef 0: no penalty
    in the loss, or the KL is in the reward), per-token or per-sequence (GSPO) ratios, and the
    entropy bonus."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    agg_mode: str = "token-mean"
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_max: float | None = 10.0
    ratio_level: str = "token"
    entropy_coef: float = 0.0


@dataclass(frozen=True)
class ValueLoss:
    """Settings of the critic's loss (`Critic.train_step`). Values are clipped to within `clip`
    of the old values (None: unclipped), and token losses are aggregated by `agg_mode`."""

    clip: float | None = 0.2
    agg_mode: str = "token-mean"


@dataclass(frozen=True)
class PreferenceLoss:
    """Settings of DPO on preference pairs (`Actor.preference_step`, pairwise.dpo_loss): `beta`,
    the loss `kind` ("sigmoid", "ipo", ...) and label smoothing. `nll_coef` > 0 adds the chosen
    responses' mean NLL per token (RPO)."""

    beta: float
    kind: str = "sigmoid"
    label_smoothing: float = 0.0
    nll_coef: float = 0.0


@dataclass(frozen=True)
class Correction:
    """Rollout correction (`rl.rollout_correction`): `kind` is "none", "tis" (truncated
    importance weights in [tis_floor, tis_cap]) or "icepop" (tokens with a ratio outside
    [icepop_low, icepop_high] are masked). `sequence_mask` is a (low, high) bound on each
    sequence's geometric-mean ratio (None: off)."""

    kind: str = "none"
    tis_cap: float = 2.0
    tis_floor: float | None = None
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    sequence_mask: tuple[float, float] | None = None
