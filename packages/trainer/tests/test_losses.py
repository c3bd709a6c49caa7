"""Policy, value and entropy losses against values worked out by hand, gradients included."""

import math

import pytest
import torch

from ferrule_trainer.losses import entropy_bonus, policy_loss, token_entropy, value_loss

# Five tokens, one for each case of the clipped objective (clip_low 0.2, clip_high 0.28, dual 3):
RATIOS = [1.5, 0.5, 0.5, 5.0, 1.1]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 2.0]
PER_TOKEN_LOSS = [
    -1.28,  # A > 0, ratio above 1 + 0.28: clipped to -1.28 A
    -0.5,  # A > 0, ratio below 1 - 0.2: the unclipped -r A is the larger loss
    0.8,  # A < 0, ratio below 1 - 0.2: clipped to -0.8 A
    3.0,  # A < 0, ratio 5: the unclipped loss 5 is capped at -3 A = 3 by the dual clip
    -2.2,  # A > 0, ratio inside the range: -1.1 * 2
]


def _policy_inputs(ratios=RATIOS):
    old_logprobs = torch.full((1, len(ratios)), math.log(0.1))
    logprobs = (old_logprobs + torch.tensor([ratios]).log()).requires_grad_()
    return logprobs, old_logprobs, torch.tensor([ADVANTAGES]), torch.ones(1, len(ratios))


def test_policy_loss_by_hand():
    logprobs, old_logprobs, advantages, mask = _policy_inputs()
    out = policy_loss(logprobs, old_logprobs, advantages, mask)
    torch.testing.assert_close(out.loss, torch.tensor(sum(PER_TOKEN_LOSS) / 5))  # -0.036
    torch.testing.assert_close(out.loss, torch.tensor(-0.036))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(2 / 5))  # tokens 0 and 2
    torch.testing.assert_close(out.dual_clip_fraction, torch.tensor(1 / 5))  # token 3
    k3 = [r - 1 - math.log(r) for r in RATIOS]
    torch.testing.assert_close(out.approx_kl, torch.tensor(sum(k3) / 5))


def test_policy_loss_gradient_flows_only_through_unclipped_tokens():
    logprobs, old_logprobs, advantages, mask = _policy_inputs()
    policy_loss(logprobs, old_logprobs, advantages, mask).loss.backward()
    # d(-r A / 5) / d logprob = -r A / 5 for the unclipped tokens 1 and 4; 0 for the others
    expected = [0.0, -0.5 * 1.0 / 5, 0.0, 0.0, -1.1 * 2.0 / 5]
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected]))


def test_policy_loss_without_dual_clip_and_with_symmetric_clip():
    logprobs, old_logprobs, advantages, mask = _policy_inputs()
    no_dual = policy_loss(logprobs, old_logprobs, advantages, mask, dual_clip=None)
    # token 3 keeps its unclipped loss 5 * 1
    torch.testing.assert_close(no_dual.loss, torch.tensor((-1.28 - 0.5 + 0.8 + 5.0 - 2.2) / 5))
    assert no_dual.dual_clip_fraction == 0
    symmetric = policy_loss(logprobs, old_logprobs, advantages, mask, clip_high=0.2)
    # token 0 is clipped at 1.2 instead of 1.28
    torch.testing.assert_close(symmetric.loss, torch.tensor((-1.2 - 0.5 + 0.8 + 3.0 - 2.2) / 5))


def test_policy_loss_importance_weights_scale_each_token():
    logprobs, old_logprobs, advantages, mask = _policy_inputs()
    weights = torch.tensor([[1.0, 0.5, 0.0, 1.0, 2.0]])
    out = policy_loss(logprobs, old_logprobs, advantages, mask, is_weights=weights)
    expected = (-1.28 - 0.5 * 0.5 + 0.0 + 3.0 - 2.2 * 2.0) / 5  # the count stays 5
    torch.testing.assert_close(out.loss, torch.tensor(expected))


def test_policy_loss_padding_never_affects_value_or_gradient():
    logprobs, old_logprobs, advantages, mask = _policy_inputs()
    clean = policy_loss(logprobs, old_logprobs, advantages, mask)
    (clean_grad,) = torch.autograd.grad(clean.loss, logprobs)

    pad = torch.tensor([[-float("inf"), 0.0]])
    padded_logprobs = torch.cat([logprobs.detach(), pad], 1).requires_grad_()
    padded = policy_loss(
        padded_logprobs,
        torch.cat([old_logprobs, torch.tensor([[float("nan"), -1e30]])], 1),
        torch.cat([advantages, torch.tensor([[float("nan"), 1e30]])], 1),
        torch.cat([mask, torch.zeros(1, 2)], 1),
    )
    (padded_grad,) = torch.autograd.grad(padded.loss, padded_logprobs)
    for a, b in zip(clean, padded, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(padded_grad, torch.cat([clean_grad, torch.zeros(1, 2)], 1))


def test_policy_loss_huge_ratio_gives_finite_gradient():
    logprobs, old_logprobs, advantages, mask = _policy_inputs(ratios=[1.0, 1.0, 1.0, 1.0, 1.0])
    logprobs = logprobs.detach().clone()
    logprobs[0, 0] = old_logprobs[0, 0] + 200.0  # exp(200) overflows float32
    logprobs.requires_grad_()
    loss = policy_loss(logprobs, old_logprobs, advantages, mask).loss
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_policy_loss_argument_errors():
    logprobs, old_logprobs, advantages, mask = _policy_inputs()
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logprobs, old_logprobs, advantages, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\)"):
        policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=1.0)
    with pytest.raises(
        ValueError, match=r"advantages has shape \(5,\) but mask has shape \(1, 5\)"
    ):
        policy_loss(logprobs, old_logprobs, advantages[0], mask)


def test_value_loss_by_hand():
    values = torch.tensor([[1.5, 1.5, 0.1]], requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    out = value_loss(values, old_values, returns, mask, clip=0.2)
    # token 0: (1.5 - 2)^2 = 0.25, clipped value 1.2: (1.2 - 2)^2 = 0.64 -> 0.64 (clip active)
    # token 1: (1.5 - 1)^2 = 0.25, clipped value 1.2: (1.2 - 1)^2 = 0.04 -> 0.25
    # token 2: moved by 0.1, inside the clip range: (0.1 - 1)^2 = 0.81
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * (0.64 + 0.25 + 0.81) / 3))  # 0.2833
    torch.testing.assert_close(out.clip_fraction, torch.tensor(1 / 3))
    out.loss.backward()
    # token 0's loss is the clipped branch's, which does not depend on values: no gradient
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5 / 3, -0.9 / 3]]))

    unclipped = value_loss(values, old_values, returns, mask, clip=None)
    torch.testing.assert_close(unclipped.loss, torch.tensor(0.5 * (0.25 + 0.25 + 0.81) / 3))


def test_value_clip_fraction_counts_no_token_inside_the_clip_range():
    """Issue 59, item 8: every value within `clip` of its old value is unclipped, whatever the
    two's magnitudes. old + (v - old).clamp(...) is not exactly v when they differ in
    magnitude, so a rounding tie made 8.5% of such tokens count as clipped at value scale 0.1."""
    generator = torch.Generator().manual_seed(0)
    old_values = 0.1 * torch.randn(64, 128, generator=generator)
    values = old_values * torch.empty(64, 128).uniform_(0.0, 2.0, generator=generator)
    values = torch.where((values - old_values).abs() < 0.2, values, old_values)  # all inside
    returns = values + 0.01 * torch.randn(64, 128, generator=generator)
    mask = torch.ones(64, 128)
    out = value_loss(values, old_values, returns, mask, clip=0.2)
    assert out.clip_fraction == 0
    unclipped = value_loss(values, old_values, returns, mask, clip=None)
    assert torch.equal(out.loss, unclipped.loss)


def test_value_loss_ignores_padding():
    values = torch.tensor([[1.5, float("nan")]])
    old_values = torch.tensor([[1.0, float("inf")]])
    returns = torch.tensor([[2.0, 3.0]])
    out = value_loss(values, old_values, returns, torch.tensor([[1, 0]]))
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * 0.64))


def test_token_entropy_by_hand():
    probs = torch.tensor([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]])
    logits = probs.log() + 7.0  # softmax does not see a shift
    # H = -(0.5 ln 0.5 + 2 * 0.25 ln 0.25) = 0.5 ln 2 + 0.5 ln 4 = 1.5 ln 2; uniform: ln 3
    expected = torch.tensor([[1.5 * math.log(2), math.log(3)]])
    torch.testing.assert_close(token_entropy(logits), expected)
    torch.testing.assert_close(token_entropy(torch.tensor([[[1000.0, 0.0]]])), torch.zeros(1, 1))


def test_entropy_bonus_is_the_mean_over_valid_tokens():
    probs = torch.tensor([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]], [[1.0, 1e-9, 1e-9]] * 2])
    mask = torch.tensor([[1, 1], [0, 0]])
    expected = (1.5 * math.log(2) + math.log(3)) / 2
    entropy = token_entropy(probs.log())
    torch.testing.assert_close(entropy_bonus(entropy, mask), torch.tensor(expected))
    with pytest.raises(ValueError, match=r"entropy must be \(batch, response_len\)"):
        entropy_bonus(entropy[:, :1], mask)


def test_gspo_sequence_ratio_has_gspos_value_and_gradient():
    """ratio_level "sequence" in the GSPO-token form equals GSPO itself (Zheng et al. 2025):
    the loss -s_i A_i with s_i = exp(mean_t log r_t), averaged over responses, in value and in
    gradient; a response whose s_i is clipped gets no gradient."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g) - 0.5
    logprobs = (old + 0.01 * torch.randn(3, 4, generator=g)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    advantages = torch.tensor([[1.0], [-2.0], [0.5]]).expand(3, 4)
    options = dict(dual_clip=None, agg_mode="seq-mean-token-mean", ratio_level="sequence")
    wide = policy_loss(logprobs, old, advantages, mask, clip_low=0.5, clip_high=0.5, **options)
    valid = mask.bool()
    s = torch.exp(torch.where(valid, logprobs - old, 0).sum(-1) / valid.sum(-1))
    reference = -(s * advantages[:, 0]).mean()
    torch.testing.assert_close(wide.loss, reference)
    (ours,) = torch.autograd.grad(wide.loss, logprobs)
    (theirs,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(ours, theirs)
    # a tiny clip range: responses whose s moved beyond it (in the direction A favours) stop
    tight = policy_loss(logprobs, old, advantages, mask, clip_low=1e-4, clip_high=1e-4, **options)
    (grad,) = torch.autograd.grad(tight.loss, logprobs)
    clipped = ((s > 1 + 1e-4) & (advantages[:, 0] > 0)) | ((s < 1 - 1e-4) & (advantages[:, 0] < 0))
    assert clipped.any() and (grad[clipped] == 0).all()
    assert (grad[~clipped][valid[~clipped]] != 0).all()
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(logprobs, old, advantages, mask, ratio_level="group")
