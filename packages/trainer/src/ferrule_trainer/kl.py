"""Per-token estimators of KL(policy || reference): k1, k2 and k3, as a reward penalty or a loss.

    kl = kl_estimate(old_logprobs, ref_logprobs, mask, kind="k1")      # reward penalty, see
    rewards = reward_shaping.token_rewards(scores, mask, kl=kl, kl_coef=0.05)   # reward_shaping
    loss = pg.loss + 0.001 * kl_loss(logprobs, ref_logprobs, mask, kind="k2")   # loss term

Source for all three: J. Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html. With x = log pi(a) - log pi_ref(a) for a token a sampled
from pi, and r = pi_ref(a) / pi(a) = exp(-x):

    k1 = x                  unbiased, high variance, can be negative
    k2 = x^2 / 2            biased (tiny when pi is close to pi_ref), low variance, >= 0
    k3 = (r - 1) - log r    unbiased, low variance, >= 0

As a loss term, the gradient matters, not the value (Tang & Munos 2025, "On a few pitfalls in KL
divergence gradient estimation for RL"). On-policy, grad E[k2] is the gradient of KL(pi || pi_ref),
grad E[k3] is the gradient of the forward KL(pi_ref || pi) (GRPO's choice), and grad E[k1] is zero
in expectation. So k1 belongs in the reward, not in the loss.
"""

import torch

from ferrule_trainer._checks import check_per_token, valid_tokens
from ferrule_trainer.aggregation import aggregate_loss

KL_ESTIMATORS = ("k1", "k2", "k3")
_MAX_ABS_LOG_RATIO = 20.0


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str,
    max_abs_estimate: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref), (batch, response_len), 0 on padding.

    logprobs:          log pi of the sampled tokens (the policy the samples came from).
    ref_logprobs:      log pi_ref of the same tokens.
    kind:              "k1", "k2" or "k3" (formulas in the module docstring, after Schulman 2020).
    max_abs_estimate:  clamps each token's estimate to [-c, c] (k2 and k3 are >= 0, so only to
                       c). k3 grows like exp(-x) where the policy gives a token far less mass
                       than the reference does. At x = -29 it is ~4e12, and one such token
                       decides a batch's loss. Capping the estimate bounds every token's share:
                       a capped token adds c and no gradient, like a token past PPO's ratio clip.
                       With c = 10, the cap starts at x ~ -2.6 for k3 (and past x ~ 11 on the
                       other side), at |x| ~ 4.47 for k2, and at |x| = 10 for k1. OpenRLHF caps
                       the same way. (Clamping x instead and then exponentiating still lets one
                       token add e^c ~ 22000, with a gradient of -e^c.) None: no cap.
    """
    check_per_token(mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kind must be one of {KL_ESTIMATORS}, got {kind!r}")
    valid = valid_tokens(mask)
    # Zero the padding before any arithmetic: pad tokens may carry -inf log-probabilities, and
    # exp(inf) would put NaN into the gradient even where the result is masked out afterwards.
    log_ratio = torch.where(valid, logprobs.float() - ref_logprobs.float(), 0.0)
    if max_abs_estimate is not None:
        if max_abs_estimate <= 0:
            raise ValueError(f"max_abs_estimate must be > 0, got {max_abs_estimate}")
        # Bounding x to +-20 keeps exp() finite, so a capped token's zero gradient is 0, not
        # 0 * inf = NaN. Past |x| = 20 a token's estimate is then its value at |x| = 20 (k1:
        # +-20, k2: 200, k3: 19 above and e^20 - 21 ~ 5e8 below), with no gradient, and a c
        # below that value caps it to c.
        log_ratio = log_ratio.clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    if kind == "k1":
        estimate = log_ratio
    elif kind == "k2":
        estimate = 0.5 * log_ratio.square()
    else:  # (r - 1) - log r with r = exp(-x); expm1 keeps precision when pi is close to pi_ref
        estimate = torch.expm1(-log_ratio) + log_ratio
    if max_abs_estimate is not None:
        estimate = estimate.clamp(-max_abs_estimate, max_abs_estimate)
    return torch.where(valid, estimate, 0.0)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str,
    max_abs_estimate: float | None = None,
    agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(pi || pi_ref) as a loss term: `kl_estimate` reduced by `aggregation.aggregate_loss`.

    GRPO (Shao et al. 2024) adds beta * mean k3 to the loss instead of penalising the reward.
    The caller multiplies the result by its coefficient. `logprobs` must carry the gradient.
    """
    per_token = kl_estimate(
        logprobs, ref_logprobs, mask, kind=kind, max_abs_estimate=max_abs_estimate
    )
    return aggregate_loss(
        per_token, mask, mode=agg_mode, num_tokens=num_tokens, num_sequences=num_sequences
    )


def adapt_kl_coef(
    coef: float, observed_kl: float, *, target: float, horizon: int, samples: int
) -> float:
    """The next KL coefficient of the adaptive controller of Ziegler et al. 2019 ("Fine-Tuning
    Language Models from Human Preferences", section 2.2):

        e = clip(observed_kl / target - 1, -0.2, 0.2)      coef <- coef (1 + e samples / horizon)

    The coefficient grows while the policy is further from the reference than `target` and
    shrinks while it is closer, by at most 20% per `horizon` samples. Here `observed_kl` and
    `target` are per token (the run's "kl" metric), not per response as in the paper.
    """
    if target <= 0 or horizon <= 0 or samples <= 0:
        raise ValueError(
            f"adapt_kl_coef needs target, horizon and samples > 0, got {target}, {horizon}, "
            f"{samples}"
        )
    if samples >= 5 * horizon:  # 1 - 0.2 samples / horizon <= 0: the sign would flip
        raise ValueError(f"samples ({samples}) must be below 5 x horizon ({horizon})")
    error = min(max(observed_kl / target - 1, -0.2), 0.2)
    return coef * (1 + error * samples / horizon)
