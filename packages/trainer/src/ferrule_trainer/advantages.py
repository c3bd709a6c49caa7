"""Advantage estimators for the PPO family: GAE, REINFORCE++(-baseline), GRPO, Dr. GRPO, RLOO.

    adv, returns = gae(token_rewards(scores, mask, kl=kl, kl_coef=0.05), values, mask)   # PPO
    adv = grpo(scores, mask, group_size=8)                                               # GRPO

Every estimator returns (batch, response_len) advantages, 0 on padding, ready for
`losses.policy_loss`. Conventions:
- `mask` marks valid response tokens (bool or 0/1). It may have holes (tool output in a
  multi-turn response); the recursions then step from one valid token to the next valid one.
- `scores` are sequence-level rewards, (batch,).
- Groups are contiguous: rows [k*n, (k+1)*n) are the n = group_size samples of prompt k, the
  order in which rollout returns n samples per prompt.
Compute advantages over the whole rollout batch at once, because the group and batch statistics
are wrong when computed per micro-batch. Inputs are detached, so advantages never carry a gradient.
"""

from typing import NamedTuple

import torch

from ferrule_trainer._checks import (
    check_groups,
    check_per_token,
    check_sequence_scores,
    valid_tokens,
)
from ferrule_trainer.aggregation import masked_mean
from ferrule_trainer.reward_shaping import token_rewards


class AdvantagesAndReturns(NamedTuple):
    advantages: torch.Tensor  # (batch, response_len), 0 on padding
    returns: torch.Tensor  # advantages + values: the critic's regression target


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> AdvantagesAndReturns:
    """Generalized Advantage Estimation (Schulman et al. 2015, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation"), for PPO with a critic.

        delta_t = r_t + gamma V_{t+1} - V_t
        A_t = delta_t + gamma lam A_{t+1}          returns_t = A_t + V_t

    t and t+1 are consecutive *valid* tokens. After the last valid token, V = A = 0 (the episode
    ends). lam = 1 gives the Monte-Carlo return minus V, and lam = 0 gives the one-step TD error.
    rewards: per-token, (batch, response_len), e.g. from `reward_shaping.token_rewards`.
    values: the critic's V(s_t) for the same tokens.
    """
    check_per_token(mask, rewards=rewards, values=values)
    valid = valid_tokens(mask)
    rewards = torch.where(valid, rewards.detach().float(), 0.0)
    values = torch.where(valid, values.detach().float(), 0.0)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # A masked position is not a step: it carries the next valid token's V and A backwards.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        advantages.append(torch.where(valid[:, t], advantage, 0.0))
    advantages = torch.stack(advantages[::-1], dim=1)
    return AdvantagesAndReturns(advantages, torch.where(valid, advantages + values, 0.0))


def discounted_returns(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1} over valid tokens (the reward-to-go), 0 on padding.

    This is GAE with V = 0 and lam = 1, so it reuses that recursion.
    """
    return gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0).advantages


def normalize_advantages(
    advantages: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8
) -> torch.Tensor:
    """Computes (A - mean) / sqrt(max(var, eps)) over every valid token of the batch (population
    variance), with 0 on padding. This is the advantage normalisation of PPO implementations and
    of REINFORCE++.

    When a batch's advantages are (nearly) all equal, naive code turns rounding noise into
    advantages of size ~1. Two guards prevent this. First, the mean is taken relative to one of
    the values (the first valid one, as in `_center_groups`), so equal values centre to exactly
    0. Second, the variance is floored at eps (as OpenRLHF does), so differences of ~1 ulp stay
    ~1e-4 times smaller after scaling instead of growing to ~1.
    """
    check_per_token(mask, advantages=advantages)
    valid = valid_tokens(mask)
    advantages = torch.where(valid, advantages.detach().float(), 0.0)
    pivot = advantages[valid][:1].sum()  # the first valid value (0 for an all-padding batch)
    shifted = torch.where(valid, advantages - pivot, 0.0)
    centered = torch.where(valid, shifted - masked_mean(shifted, valid), 0.0)
    variance = masked_mean(centered.square(), valid)
    return torch.where(valid, centered * variance.clamp(min=eps).rsqrt(), 0.0)


def reinforce_plus_plus(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"): PPO's tricks without a critic.

        r_t = -kl_coef kl_t, plus the score on the last valid token
        G_t = sum_{s >= t} gamma^(s-t) r_s          A = (G - mean G) / std G over the batch

    kl: per-token KL estimate (`kl.kl_estimate`, k1 in the paper) between the rollout policy and
    the reference; None for no penalty. turn_rewards: rewards earned before the end, as
    `token_rewards` takes them (multi-turn episodes).
    """
    check_sequence_scores(scores, mask)
    rewards = token_rewards(scores, mask, kl=kl, kl_coef=kl_coef, turn_rewards=turn_rewards)
    return normalize_advantages(discounted_returns(rewards, mask, gamma=gamma), mask)


def reinforce_plus_plus_baseline(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): REINFORCE++ on scores minus their group's mean.

        s_i' = s_i - mean_{j in group(i)} s_j,   then `reinforce_plus_plus` on s'

    The group mean removes the prompt's difficulty. The batch-wide normalisation replaces
    GRPO's per-group std, which Hu argues over-weighs groups that are almost all right or all
    wrong. The KL may go into the reward (kl, kl_coef) or into the loss (`kl.kl_loss`).
    """
    check_sequence_scores(scores, mask)
    centered = _center_groups(scores.detach().float(), group_size)
    return reinforce_plus_plus(centered, mask, kl=kl, kl_coef=kl_coef, gamma=gamma)


def grpo(
    scores: torch.Tensor, mask: torch.Tensor, *, group_size: int, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, "DeepSeekMath"), outcome supervision: every token of sample i
    gets A_i = (s_i - mean(group)) / (std(group) + eps).

    std is the sample standard deviation (Bessel's correction), as in the common
    implementations. A group whose scores are all equal gets exactly A = 0, whatever the value
    (see `_center_groups`).
    """
    check_sequence_scores(scores, mask)
    centered = _center_groups(scores.detach().float(), group_size).reshape(-1, group_size)
    std = (centered.square().sum(-1, keepdim=True) / (group_size - 1)).sqrt()
    return _broadcast_to_tokens((centered / (std + eps)).view(-1), mask)


def dr_grpo(scores: torch.Tensor, mask: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective"): A_i = s_i - mean(group). This is GRPO without the division by the group's
    std, which up-weighs prompts that are too easy or too hard. The paper's other fix, dropping
    the division by the response length, lives in the loss aggregation: "token-mean" or
    "seq-mean-token-sum".
    """
    check_sequence_scores(scores, mask)
    return _broadcast_to_tokens(_center_groups(scores.detach().float(), group_size), mask)


def rloo(scores: torch.Tensor, mask: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """RLOO, REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics:
    Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"):

        A_i = s_i - (1 / (n - 1)) sum_{j in group(i), j != i} s_j  =  n / (n - 1) (s_i - mean)

    The baseline excludes the sample itself, so it is unbiased. Ahmadian et al. put the KL
    penalty into the sequence score: pass scores - kl_coef * (kl * mask).sum(-1) for that.
    """
    check_sequence_scores(scores, mask)
    centered = _center_groups(scores.detach().float(), group_size)
    return _broadcast_to_tokens(centered * (group_size / (group_size - 1)), mask)


def _center_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Returns each score minus its group's mean, (batch,), computed relative to the group's first
    score: s_i - mean = (s_i - s_0) - mean_j (s_j - s_0). Equal scores then centre to exactly 0.
    The naive s_i - mean(s) does not: 0.1 is not exact in binary, so the mean of eight float32
    0.1s misses 0.1 by an ulp, and GRPO's division by a ~0 std blows that ulp up to ~0.01-0.2."""
    check_groups(scores, group_size)
    grouped = scores.reshape(-1, group_size)
    shifted = grouped - grouped[:, :1]
    return (shifted - shifted.mean(-1, keepdim=True)).reshape(-1)


def _broadcast_to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(valid_tokens(mask), per_sequence[:, None], 0.0)
