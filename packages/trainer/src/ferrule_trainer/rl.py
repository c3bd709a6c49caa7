"""One RL step's data and math: rollout samples to a batch, advantages by estimator, PPO epochs.

    batch = build_batch(samples, pad_id)              # a Batch (batch.py)
    weights, metrics = rollout_correction(old, rollout_logprobs(samples, batch), batch, correction)
    advantages, returns = estimate("grpo", scores, batch, group_size=8, old_logprobs=old)
    actor.train_epochs(policy_batch(batch, old, advantages, ref, 0.0), EpochPlan(), PolicyLoss())
    critic.train_epochs(critic_batch(batch, values, returns), EpochPlan(), ValueLoss())  # "gae"

The process that drives the loop (ferrule-launcher) moves these batches between processes;
this module decides what the batches hold and what is done with them. Samples are plain objects
with `prompt_token_ids` and `token_ids` (ferrule-rollout's `Sample`, or anything shaped like it).
Imports torch only.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ferrule_trainer import advantages as adv
from ferrule_trainer import importance
from ferrule_trainer.aggregation import masked_mean
from ferrule_trainer.batch import Batch
from ferrule_trainer.kl import adapt_kl_coef, kl_estimate
from ferrule_trainer.reward_shaping import (
    RunningMoments,
    overlong_penalty,
    shape_scores,
    token_rewards,
)
from ferrule_trainer.sequences import plan_micro_batches
from ferrule_trainer.settings import Correction, EpochPlan

T = TypeVar("T")

__all__ = [
    "ESTIMATORS",
    "EstimatorInputs",
    "RunningMoments",
    "adapt_kl_coef",
    "build_batch",
    "critic_batch",
    "estimate",
    "keep_groups",
    "mean_kl",
    "overlong_penalty",
    "policy_batch",
    "ppo_epochs",
    "rollout_correction",
    "rollout_logprobs",
    "shape_scores",
    "trim_groups",
]


def build_batch(samples: Sequence, pad_id: int) -> Batch:
    """Builds input_ids, attention_mask and response_mask from samples. Prompts are left-padded
    and responses right-padded, so every response starts at the same column. A sample's `mask`,
    where it has one, becomes its response_mask. In multi-turn episodes the mask is 0 on the
    tokens an environment inserted: those tokens are attended to but get no loss, no KL and no
    advantage."""
    prompt_len = max(len(s.prompt_token_ids) for s in samples)
    response_len = max(max(len(s.token_ids) for s in samples), 1)
    rows = len(samples)
    input_ids = torch.full((rows, prompt_len + response_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros((rows, response_len), dtype=torch.long)
    for row, sample in enumerate(samples):
        prompt, response = sample.prompt_token_ids, sample.token_ids
        input_ids[row, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        attention_mask[row, prompt_len - len(prompt) : prompt_len] = 1
        if response:
            input_ids[row, prompt_len : prompt_len + len(response)] = torch.tensor(response)
            attention_mask[row, prompt_len : prompt_len + len(response)] = 1
            mask = getattr(sample, "mask", None)
            if mask is None:
                response_mask[row, : len(response)] = 1
            elif len(mask) == len(response):
                response_mask[row, : len(response)] = torch.tensor(mask)
            else:
                raise ValueError(
                    f"sample {row}: mask has {len(mask)} entries for {len(response)} tokens"
                )
    return Batch(input_ids, attention_mask, response_mask)


def turn_rewards(samples: Sequence, batch: Batch) -> torch.Tensor | None:
    """The rewards that samples earned before their end, in the layout of
    `batch.response_mask`, for `estimate`. They come from each sample's `turn_rewards`
    (multi-turn episodes: (token index, reward) pairs). None when no sample has any."""
    if not any(getattr(s, "turn_rewards", None) for s in samples):
        return None
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    for row, sample in enumerate(samples):
        for index, reward in getattr(sample, "turn_rewards", None) or ():
            if not 0 <= index < len(sample.token_ids):
                raise ValueError(
                    f"sample {row}: a turn reward at token {index}; it has "
                    f"{len(sample.token_ids)} tokens"
                )
            out[row, index] += reward
    return out


def rollout_logprobs(samples: Sequence, batch: Batch) -> torch.Tensor:
    """The engine's log-probabilities of the sampled tokens (`Sample.logprobs`: the behaviour
    policy) in the layout of `batch.response_mask`, 0 on padding."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    for row, sample in enumerate(samples):
        out[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return out


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    batch: Batch,
    correction: Correction = Correction(),
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Per-token weights for the policy loss, and metrics. The weights correct for the engine
    and the trainer giving the same tokens different probabilities ("tis", "icepop": see
    `importance`), and are multiplied by a sequence mask when `correction.sequence_mask` =
    (low, high). They are None when neither is on. The metrics, returned every step, are
    "vllm_kl" (the k3 estimate of KL(engine || trainer) per token, since the samples come from
    the engine) and the fractions of tokens and sequences that the correction changed."""
    c, kind = correction, correction.kind
    mask = batch.response_mask
    metrics = {
        "vllm_kl": float(
            masked_mean(kl_estimate(rollout_logprobs, old_logprobs, mask, kind="k3"), mask.bool())
        )
    }
    weights = None
    if kind == "tis":
        tis = importance.truncated_is_weights(
            old_logprobs, rollout_logprobs, mask, cap=c.tis_cap, floor=c.tis_floor
        )
        weights, metrics["rollout_correction/truncated"] = tis.weights, float(tis.fraction)
    elif kind == "icepop":
        icepop = importance.icepop_weights(
            old_logprobs, rollout_logprobs, mask, low=c.icepop_low, high=c.icepop_high
        )
        weights, metrics["rollout_correction/masked"] = icepop.weights, float(icepop.fraction)
    elif kind != "none":
        raise ValueError(f"unknown rollout correction {kind!r}")
    if c.sequence_mask is not None:
        low, high = c.sequence_mask
        keep = importance.sequence_mask(old_logprobs, rollout_logprobs, mask, low=low, high=high)
        base = weights if weights is not None else mask.float()
        weights = base * keep[:, None]
        metrics["rollout_correction/masked_sequences"] = float((~keep).float().mean())
    return weights, metrics


def keep_groups(scores: torch.Tensor, group_size: int, low: float, high: float) -> list[int]:
    """DAPO's dynamic sampling (Yu et al. 2025): the indices of the prompt groups whose mean
    score lies strictly between low and high. With 0/1 rewards and bounds (0, 1), this drops the
    groups whose samples were all wrong or all right. Under a group estimator every sample of
    such a group has advantage 0, so the group would only shrink the batch's gradient. The mean
    is taken relative to the group's first score, so the mean of an all-equal group is exactly
    that score, and a bound equal to the score drops the group."""
    grouped = scores.detach().float().reshape(-1, group_size)
    means = grouped[:, 0] + (grouped - grouped[:, :1]).mean(-1)
    # Compared as float32 tensors: the bounds round as the scores did (0.1 == float32 0.1).
    return torch.nonzero((means > low) & (means < high)).flatten().tolist()


def trim_groups(groups: Sequence[T], group_size: int, multiple: int) -> list[T]:
    """The first prompt groups, as many as make a multiple of `multiple` rows, so that every
    rank of the policy, the reference and the critic takes an equal share of every mini-batch
    (`TrainerConfig.batch_multiple`)."""
    keep = list(groups)
    while len(keep) * group_size % multiple:
        keep.pop()
    return keep


@dataclass(frozen=True)
class EstimatorInputs:
    """What an estimator may use beyond the scores and the response mask."""

    group_size: int
    values: torch.Tensor | None  # the critic's values ("gae")
    kl: torch.Tensor | None  # per-token KL to the reference, with kl_in = "reward"
    kl_coef: float
    gamma: float
    lam: float
    turn_rewards: torch.Tensor | None


def _gae(scores, mask, x: EstimatorInputs):
    rewards = token_rewards(scores, mask, kl=x.kl, kl_coef=x.kl_coef, turn_rewards=x.turn_rewards)
    advantages, returns = adv.gae(rewards, x.values, mask, gamma=x.gamma, lam=x.lam)
    return adv.normalize_advantages(advantages, mask), returns


def _reinforce_plus_plus(scores, mask, x: EstimatorInputs):
    advantages = adv.reinforce_plus_plus(
        scores, mask, gamma=x.gamma, kl=x.kl, kl_coef=x.kl_coef, turn_rewards=x.turn_rewards
    )
    return advantages, None


def _reinforce_plus_plus_baseline(scores, mask, x: EstimatorInputs):
    advantages = adv.reinforce_plus_plus_baseline(
        scores, mask, group_size=x.group_size, gamma=x.gamma, kl=x.kl, kl_coef=x.kl_coef
    )
    return advantages, None


def _group(estimator: Callable) -> Callable:
    """A group-relative estimator: each sample's score against its prompt group's."""
    return lambda scores, mask, x: (estimator(scores, mask, group_size=x.group_size), None)


# Maps each [trainer] estimator to a function
# (scores, response mask, inputs) -> (advantages, returns or None).
# The returns are the critic's targets ("gae" only). To add an estimator, add an entry here and
# its name to config.ESTIMATORS.
ESTIMATORS: dict[str, Callable] = {
    "gae": _gae,
    "grpo": _group(adv.grpo),
    "dr_grpo": _group(adv.dr_grpo),
    "rloo": _group(adv.rloo),
    "reinforce_plus_plus": _reinforce_plus_plus,
    "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
}


def estimate(
    estimator: str,
    scores: torch.Tensor,
    batch: Batch,
    *,
    group_size: int,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k1",
    kl_in: str = "loss",
    kl_max: float | None = 10.0,
    gamma: float = 1.0,
    lam: float = 0.95,
    turn_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, returns) for `estimator`, one of ESTIMATORS. returns is None except for
    "gae", where it is the critic's target. With kl_in = "reward" (and kl_coef > 0), the KL of
    the rollout policy to the reference is a per-token reward penalty (PPO, REINFORCE++);
    otherwise the loss carries it. `turn_rewards` comes from multi-turn episodes
    (`turn_rewards(samples, batch)`). The estimators with per-token rewards ("gae",
    "reinforce_plus_plus") credit each turn's reward at its own turn; the group estimators use
    only the scores (each episode's total)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; estimators are {sorted(ESTIMATORS)}")
    mask = batch.response_mask
    kl = None
    if kl_in == "reward" and kl_coef > 0:
        kl = kl_estimate(old_logprobs, ref_logprobs, mask, kind=kl_kind, max_abs_estimate=kl_max)
    inputs = EstimatorInputs(
        group_size=group_size,
        values=values,
        kl=kl,
        kl_coef=kl_coef if kl is not None else 0.0,
        gamma=gamma,
        lam=lam,
        turn_rewards=turn_rewards,
    )
    return ESTIMATORS[estimator](scores, mask, inputs)


def policy_batch(
    batch: Batch,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    kl_coef_in_loss: float,
    is_weights: torch.Tensor | None = None,
) -> Batch:
    """What `Actor.train_step` reads: the layout, the old log-probs (None: an on-policy step
    takes them from its own forward), the advantages, the reference's log-probs when the loss
    carries a KL term, and the rollout correction's weights when there are any."""
    return batch.replace(
        advantages=advantages,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs if kl_coef_in_loss else None,
        is_weights=is_weights,
    )


def critic_batch(batch: Batch, values: torch.Tensor, returns: torch.Tensor) -> Batch:
    """What `Critic.train_step` reads: the layout, the values before the update, the returns."""
    return Batch(
        batch.input_ids,
        batch.attention_mask,
        batch.response_mask,
        old_values=values,
        returns=returns,
    )


def ppo_epochs(
    train_step: Callable[[list[Batch], bool], dict[str, float]],
    batch: Batch,
    plan: EpochPlan,
    unit: int = 1,
) -> dict[str, float]:
    """Runs `plan.epochs` passes over `batch`, each taking `plan.mini_batches` optimizer steps.
    Each step calls `train_step(micro_batches, packed)` on one mini-batch, split into
    micro-batches of at most `plan.micro_batch_size` rows (None: one micro-batch). With
    `plan.micro_batch_tokens`, each mini-batch's rows are sorted by length into micro-batches of
    at most that many tokens (`sequences.plan_micro_batches`). With `plan.pack_sequences`, each
    micro-batch is one row without padding (packed=True). The step's loss is aggregated over the
    counts of the whole mini-batch, so the split does not change it. `unit` is the number of
    rows that stay together in every mini- and micro-batch (2: preference pairs).

    Returns each metric's mean over the steps, except "skipped" (how many updates were skipped
    for non-finite gradients) and "nonfinite" (where the non-finite gradients were, if any)."""
    size = max(batch.rows // unit // plan.mini_batches, 1) * unit
    micro = max((plan.micro_batch_size or size) // unit, 1) * unit
    packed = plan.pack_sequences

    def micro_batches(mini: Batch) -> list[Batch]:
        if plan.micro_batch_tokens is None:
            return mini.split(micro)
        rows = plan_micro_batches(
            mini, max_rows=micro, max_tokens=plan.micro_batch_tokens, packed=packed, unit=unit
        )
        return [mini.take(taken) for taken in rows]

    totals: dict[str, float] = {}
    where: list[str] = []  # where each skipped update's non-finite gradients were
    steps = 0
    for _ in range(plan.epochs):
        for mini in batch.split(size):
            metrics = train_step(micro_batches(mini), packed)
            if "nonfinite" in metrics:
                where.append(f"update {steps + 1}: {metrics.pop('nonfinite') or 'not located'}")
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            steps += 1
    result = {key: value / steps for key, value in totals.items()}
    if "skipped" in totals:  # a count of updates, not a mean
        result["skipped"] = totals["skipped"]
    if where:
        result["nonfinite"] = "; ".join(where)
    return result


def mean_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(policy || reference) per response token, estimated with k1 (the metric "kl")."""
    per_token = kl_estimate(logprobs, ref_logprobs, mask, kind="k1")
    return float(masked_mean(per_token, mask.bool()))
