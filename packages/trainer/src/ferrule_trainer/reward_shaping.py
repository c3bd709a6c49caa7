"""From sequence scores to the rewards the estimators use: normalise, clip, spread over tokens.

    moments = update_moments(moments, scores)                # running statistics, a NamedTuple
    scores = clip_rewards(normalize_rewards(scores, moments=moments), low=-5.0, high=5.0)
    rewards = token_rewards(scores, mask, kl=kl, kl_coef=0.05)   # per token, for GAE/REINFORCE++

These are pure functions. The running statistics are a value that the caller keeps and
checkpoints (its fields are plain Python numbers), never state hidden in this module.
"""

from typing import NamedTuple

import torch

from ferrule_trainer._checks import check_per_token, check_sequence_scores, valid_tokens


class RunningMoments(NamedTuple):
    """Count, mean and population variance of every score seen so far."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0


def update_moments(moments: RunningMoments, scores: torch.Tensor) -> RunningMoments:
    """Returns `moments` merged with a new batch of scores.

    Chan, Golub & LeVeque (1979) parallel update: with delta = mean_b - mean_a and n = n_a + n_b,
    mean = mean_a + delta n_b / n and M2 = M2_a + M2_b + delta^2 n_a n_b / n (M2 = var * count).
    The result is exact for any split of the data into batches, and it is stable where
    sum(x^2) - n mean^2 is not.
    """
    scores = scores.detach().double().flatten()
    n_b = scores.numel()
    if n_b == 0:
        return moments
    mean_b = scores.mean().item()
    m2_b = (scores - mean_b).square().sum().item()
    n = moments.count + n_b
    delta = mean_b - moments.mean
    mean = moments.mean + delta * n_b / n
    m2 = moments.var * moments.count + m2_b + delta**2 * moments.count * n_b / n
    return RunningMoments(n, mean, m2 / n)


def normalize_rewards(
    scores: torch.Tensor, *, moments: RunningMoments | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """Returns (s - mean) / sqrt(max(var, eps)). The mean and (population) variance come from
    `moments`, or from this batch when `moments` is None. Equal scores give exactly 0 (the batch
    mean is taken relative to one of the scores), and the variance floor keeps ulp-sized spreads
    from being blown up.

    Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences") shift and scale
    the reward model to mean 0, std 1. OpenRLHF does the same with a fixed mean and std saved
    from the reward model's evaluation set. Running moments instead follow the scores that the
    policy actually earns as it changes, and they need no reward model (rule rewards have no
    evaluation set). A stable scale keeps the KL coefficient and the value loss meaningful
    across reward models.
    """
    scores = scores.detach().float()
    if moments is None:
        shifted = scores - scores.flatten()[:1].sum()  # relative to the first score
        centered = shifted - shifted.mean()
        variance = centered.square().mean()
    elif moments.count == 0:
        raise ValueError("moments has count 0: call update_moments(moments, scores) first")
    else:
        centered, variance = scores - moments.mean, torch.tensor(moments.var)
    return centered * variance.clamp(min=eps).rsqrt()


def clip_rewards(scores: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """Clamps scores to [low, high], so that one outlier of a reward model (or a bug in a reward
    function) cannot dominate the batch's advantages or blow up the critic's targets."""
    if not low < high:
        raise ValueError(f"clip_rewards needs low < high, got low={low}, high={high}")
    return scores.clamp(low, high)


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns per-token rewards, (batch, response_len), 0 on padding: the sequence score on the
    last valid token, and the KL penalty -kl_coef * kl_t on every valid token.

        r_t = -kl_coef kl_t + [t is the last valid token] s

    turn_rewards, (batch, response_len), holds rewards earned before the end: in a multi-turn
    episode, each turn's reward sits on that turn's last token (`rl.turn_rewards`). These
    rewards stay where they are, and the last valid token carries the score minus the row's sum
    of turn rewards. So each row still adds up to its score, and whatever shaping changed the
    score by lands at the end.

    The KL-penalised reward of Ziegler et al. 2019 and InstructGPT (Ouyang et al. 2022), used
    by PPO (with `advantages.gae`) and REINFORCE++. kl: per-token estimates from
    `kl.kl_estimate` (k1 is the usual choice here); None or kl_coef = 0 for no penalty.
    """
    check_sequence_scores(scores, mask)
    check_per_token(mask, kl=kl, turn_rewards=turn_rewards)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    valid = valid_tokens(mask)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(valid, positions, -1).amax(-1)
    if (last < 0).any():  # a score with no token to sit on would be lost without a trace
        empty = torch.nonzero(last < 0).flatten().tolist()
        raise ValueError(f"mask has rows without a valid token: {empty}; drop those samples")
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=scores.device)
    if kl is not None and kl_coef:
        rewards = torch.where(valid, -kl_coef * kl.detach().float(), 0.0)
    at_the_end = scores.detach().float()
    if turn_rewards is not None:
        earlier = torch.where(valid, turn_rewards.detach().float(), 0.0)
        rewards = rewards + earlier
        at_the_end = at_the_end - earlier.sum(-1)
    return rewards.scatter_add(1, last[:, None], at_the_end[:, None])


def shape_scores(
    scores: torch.Tensor, moments: RunningMoments, *, norm: str, clip: float | None
) -> tuple[torch.Tensor, RunningMoments]:
    """Returns the scores an RL step trains on and the running moments after this batch. The
    scores are normalised by `norm` ("none"; "batch": this batch's mean and std; "running": the
    moments of every score so far, this batch's included), then clipped to [-clip, clip] (None:
    no clip)."""
    if norm == "running":
        moments = update_moments(moments, scores)
        scores = normalize_rewards(scores, moments=moments)
    elif norm == "batch":
        scores = normalize_rewards(scores)
    elif norm != "none":
        raise ValueError(f'norm must be "none", "batch" or "running", got {norm!r}')
    if clip is not None:
        scores = clip_rewards(scores, low=-clip, high=clip)
    return scores, moments


def overlong_penalty(
    lengths: torch.Tensor, *, max_tokens: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", eq. 13), to add to the scores: 0 for responses of up to
    max_tokens - buffer tokens, then falling linearly to -factor at max_tokens.

        penalty(L) = -factor min(max(L - (max_tokens - buffer), 0) / buffer, 1)

    A response cut off at the limit has no answer to score; the ramp tells the policy that
    length is the problem before it hits the wall."""
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"buffer must be in (0, max_tokens = {max_tokens}], got {buffer}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    over = (lengths.float() - (max_tokens - buffer)).clamp(min=0) / buffer
    return -factor * over.clamp(max=1.0)
