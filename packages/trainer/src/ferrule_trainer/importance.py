"""Correct for the gap between the rollout engine's and the trainer's log-probabilities.

    w = truncated_is_weights(old_logprobs, rollout_logprobs, mask, cap=2.0)     # or icepop_weights
    pg = policy_loss(logprobs, old_logprobs, advantages, mask, is_weights=w.weights)

vLLM and the trainer compute different probabilities for the same tokens with the same weights
(other kernels, other precision, MoE routing), so a batch that looks on-policy is slightly
off-policy. Both corrections weight each token's loss by the ratio pi_trainer / pi_rollout of
the sampled token, computed before the update (old_logprobs). They differ in what they do with
extreme ratios. The weights are constants, so no gradient flows through them.
"""

import math
from typing import NamedTuple

import torch

from ferrule_trainer._checks import check_per_token, valid_tokens
from ferrule_trainer.aggregation import masked_mean


class ImportanceWeights(NamedTuple):
    weights: torch.Tensor  # (batch, response_len), detached, 0 on padding
    fraction: torch.Tensor  # share of valid tokens with a truncated (TIS) or masked (ICEPOP) ratio


def truncated_is_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    floor: float | None = None,
) -> ImportanceWeights:
    """Truncated importance sampling, TIS (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"):

        w_t = min(pi_trainer(a_t) / pi_rollout(a_t), cap)      (max(., floor) with a floor)

    Truncating only from above bounds the variance and keeps every token in the gradient;
    the paper uses cap = 2. A floor keeps a token that the trainer finds far less likely than
    the engine did from vanishing from the gradient. `fraction` is the share of valid tokens whose
    ratio was outside [floor, cap].
    """
    ratio, valid = _ratio(trainer_logprobs, rollout_logprobs, mask)
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if floor is not None and not 0 <= floor < cap:
        raise ValueError(f"floor must be in [0, cap = {cap}), got {floor}")
    low = 0.0 if floor is None else floor
    weights = torch.where(valid, ratio.clamp(min=low, max=cap), 0.0)
    return ImportanceWeights(weights, masked_mean(((ratio > cap) | (ratio < low)).float(), valid))


def icepop_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 5.0,
) -> ImportanceWeights:
    """IcePop (Ant Group Ling/Ring team 2025, blog "Small Leak Can Sink a Great Ship: Boost RL
    Training on MoE with IcePop!", used for Ring-1T): double-sided masking of the ratio.

        w_t = k_t if low <= k_t <= high else 0,    k_t = pi_trainer(a_t) / pi_rollout(a_t)

    Tokens on which the two engines disagree badly are dropped from the gradient instead of
    being truncated, since their gradient is mostly noise from the mismatch. The other tokens
    get the plain IS weight. The defaults [0.5, 5] are the blog's. `fraction` is the share of
    valid tokens masked out.
    """
    ratio, valid = _ratio(trainer_logprobs, rollout_logprobs, mask)
    if not 0 <= low < high:
        raise ValueError(f"icepop_weights needs 0 <= low < high, got low={low}, high={high}")
    kept = (ratio >= low) & (ratio <= high)
    weights = torch.where(valid & kept, ratio, 0.0)
    return ImportanceWeights(weights, masked_mean((~kept).float(), valid))


def sequence_mask(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
) -> torch.Tensor:
    """Returns which sequences to keep, (batch,) bool: those whose geometric-mean ratio

        rho_i = exp(mean_t log(pi_trainer(a_t) / pi_rollout(a_t)))     over i's valid tokens

    lies in [low, high]. A token-level weight cannot tell a long response that the two engines
    disagree on throughout from a response with a few bad tokens. The per-token mean of the
    log-ratio can, and unlike the product of ratios it does not shrink with length. Multiply the
    mask into the token weights to drop whole sequences (verl's "sequence-level masking"; GSPO
    likewise argues that the sequence is the unit of a reward)."""
    if not 0 <= low < 1 < high:
        raise ValueError(f"sequence_mask needs 0 <= low < 1 < high, got low={low}, high={high}")
    check_per_token(mask, trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs)
    valid = valid_tokens(mask)
    log_ratio = torch.where(valid, trainer_logprobs.detach().float() - rollout_logprobs.float(), 0)
    mean = log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)
    lowest = math.log(low) if low > 0 else -math.inf
    return (mean >= lowest) & (mean <= math.log(high))


def _ratio(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_per_token(mask, trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs)
    valid = valid_tokens(mask)
    log_ratio = trainer_logprobs.detach().float() - rollout_logprobs.detach().float()
    return torch.exp(torch.where(valid, log_ratio, 0.0)), valid
