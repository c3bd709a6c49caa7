"""PPO-family losses: clipped policy loss (clip-higher, dual-clip), clipped value loss, entropy.

    pg = policy_loss(logprobs, old_logprobs, advantages, mask, num_tokens=step_tokens)
    vl = value_loss(values, old_values, returns, mask, num_tokens=step_tokens)
    loss = pg.loss + vf_coef * vl.loss - entropy_coef * entropy_bonus(entropy, mask, ...)

Every loss takes the (batch, response_len) `mask` of valid response tokens and reduces the
per-token losses with `aggregation.aggregate_loss` (agg_mode, num_tokens and num_sequences are
passed through to it). Padding never reaches the result or its gradient, whatever values it
holds. The statistics are detached means over this micro-batch's valid tokens, for logging.
"""

from typing import NamedTuple

import torch

from ferrule_trainer._checks import check_per_token, valid_tokens
from ferrule_trainer.aggregation import aggregate_loss, masked_mean

# exp() of a large log-ratio overflows to inf, and inf * 0 is NaN in the backward pass, even on
# the branch that min/max did not pick. A ratio of e^20 is far outside any clip range.
_MAX_LOG_RATIO = 20.0


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar, carries the gradient
    clip_fraction: torch.Tensor  # tokens whose ratio was clipped (the clipped term was chosen)
    dual_clip_fraction: torch.Tensor  # tokens with A < 0 whose loss was capped at -c * A
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_old || pi_theta) per token


class ValueLoss(NamedTuple):
    loss: torch.Tensor  # scalar, carries the gradient
    clip_fraction: torch.Tensor  # tokens where the clipped value's error was the larger one


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
    ratio_level: str = "token",
    agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> PolicyLoss:
    """The PPO clipped surrogate loss per token, reduced over the step.

    With ratio r = exp(logprobs - old_logprobs) and advantage A:

        l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)      PPO, Schulman et al. 2017
        l = min(l, -dual_clip A)   where A < 0                      dual-clip, Ye et al. 2019
        l = w l                    with w = is_weights              truncated IS / ICEPOP

    clip_high > clip_low is DAPO's clip-higher (Yu et al. 2025): a wider upper bound lets
    unlikely tokens with positive advantage grow, which keeps entropy from collapsing.
    dual_clip (> 1, None to disable) bounds the loss of a token with A < 0 whose ratio has run
    far above 1 ("Mastering Complex Control in MOBA Games with Deep RL", Ye et al. 2019).
    is_weights: per-token rollout/trainer correction weights from `importance` (treated as
    constants); a weight of 0 removes the token from the gradient but not from num_tokens.
    ratio_level "sequence" is GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization").
    Every token of a response takes the response's geometric-mean ratio
    s = exp(mean_t log r_t), which is clipped for the response as a whole. The GSPO-token form
    s_t = sg[s] pi(a_t) / sg[pi(a_t)] has the value s and the gradient s grad log pi(a_t). One
    token's noise no longer decides a clip; the paper's clip ranges are ~3e-4 / 4e-4, not 0.2.
    GSPO is a per-sequence objective: with agg_mode "seq-mean-token-mean" (which [trainer]
    ratio_level = "sequence" brings) it agrees exactly with OpenRLHF's and verl's GSPO. Every
    log-ratio, including a sequence's mean, is clamped to +-_MAX_LOG_RATIO before exp, so that
    one far-off sequence cannot overflow the loss. OpenRLHF clamps none, and verl clamps only
    from above (at +10), so both agree with this function wherever |mean log-ratio| <= 10.
    """
    check_per_token(
        mask,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        is_weights=is_weights,
    )
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f'ratio_level must be "token" or "sequence", got {ratio_level!r}')
    valid = valid_tokens(mask)
    log_ratio = torch.where(valid, logprobs.float() - old_logprobs.float(), 0.0)
    if ratio_level == "sequence":
        per_sequence = log_ratio.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
        own = logprobs.float() - logprobs.float().detach()  # 0, with the token's gradient
        log_ratio = torch.where(valid, per_sequence.detach() + own, 0.0)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    advantages = torch.where(valid, advantages.float(), 0.0)

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(valid)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    if is_weights is not None:
        per_token = per_token * torch.where(valid, is_weights.detach().float(), 0.0)

    loss = aggregate_loss(
        per_token, valid, mode=agg_mode, num_tokens=num_tokens, num_sequences=num_sequences
    )
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).float(), valid)
        dual_clip_fraction = masked_mean(dual_clipped.float(), valid)
        approx_kl = masked_mean(ratio - 1 - log_ratio, valid)
    return PolicyLoss(loss, clip_fraction, dual_clip_fraction, approx_kl)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> ValueLoss:
    """The critic's squared error with PPO value clipping, reduced over the step.

        v_clip = clip(values, old_values - clip, old_values + clip)
        l = 1/2 max((values - returns)^2, (v_clip - returns)^2)

    As in OpenAI baselines' PPO2 (Schulman et al. 2017): the new value may move at most `clip`
    from the value at rollout time before the loss stops rewarding the move. `clip` is in reward
    units; None gives the plain 1/2 squared error.
    """
    check_per_token(mask, values=values, old_values=old_values, returns=returns)
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 (or None to disable), got {clip}")
    valid = valid_tokens(mask)
    values = torch.where(valid, values.float(), 0.0)
    old_values = torch.where(valid, old_values.float(), 0.0)
    returns = torch.where(valid, returns.float(), 0.0)

    squared_error = (values - returns).square()
    clip_active = torch.zeros_like(valid)
    if clip is not None:
        # Clamp the value itself into old +- clip, as verl does. Inside the range the result is
        # exactly `values`, so no rounding tie counts an unclipped token as clipped.
        # (old + (v - old).clamp(...) is not always v when the two differ in magnitude.)
        values_clipped = torch.clamp(values, old_values - clip, old_values + clip)
        clipped_error = (values_clipped - returns).square()
        clip_active = clipped_error > squared_error
        squared_error = torch.maximum(squared_error, clipped_error)
    loss = aggregate_loss(
        0.5 * squared_error,
        valid,
        mode=agg_mode,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )
    return ValueLoss(loss, masked_mean(clip_active.float(), valid))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension: H = logsumexp(z) - sum_v softmax(z)_v z_v.

    The same as -sum p log p, written so that large logits do not overflow. (batch, len, vocab)
    logits give (batch, len). It upcasts to float32, which copies the logits, so for long
    responses and large vocabularies call it on chunks of the sequence. Logits must be finite.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean policy entropy over the step's response tokens, to be subtracted (times a coefficient)
    from the loss to reward exploration (Mnih et al. 2016, A3C; Schulman et al. 2017, PPO).
    `entropy` is (batch, response_len), one value per token, from `token_entropy` or from
    `sequences.response_logprobs(..., entropy=True)` (which never holds the whole logits)."""
    if entropy.shape != mask.shape:
        raise ValueError(
            f"entropy must be (batch, response_len) like mask {tuple(mask.shape)}, "
            f"got shape {tuple(entropy.shape)}"
        )
    return aggregate_loss(
        entropy,
        mask,
        mode=agg_mode,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )
