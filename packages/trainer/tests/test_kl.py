"""KL estimators k1, k2, k3 by hand; their expectations and gradients over a whole distribution."""

import math

import pytest
import torch

from ferrule_trainer.kl import kl_estimate, kl_loss


def test_k1_k2_k3_by_hand():
    # pi(a) = 0.5, pi_ref(a) = 0.25: x = log 2, r = pi_ref / pi = 0.5
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref_logprobs = torch.tensor([[math.log(0.25), math.log(0.5)]])
    mask = torch.ones(1, 2)
    ln2 = math.log(2)
    expected = {
        "k1": [ln2, -ln2],
        "k2": [ln2**2 / 2, ln2**2 / 2],  # 0.2402
        "k3": [(0.5 - 1) + ln2, (2 - 1) - ln2],  # 0.1931, 0.3069
    }
    for kind, values in expected.items():
        out = kl_estimate(logprobs, ref_logprobs, mask, kind=kind)
        torch.testing.assert_close(out, torch.tensor([values]), msg=kind)


def _two_distributions():
    pi = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    return pi, ref


def _expectation_under_pi(kind, pi, ref):
    """E_{a ~ pi}[k(a)], exactly: every token of the vocabulary, weighted by pi."""
    values = kl_estimate(pi.log()[None], ref.log()[None], torch.ones(1, 4), kind=kind)[0]
    return (pi * values.double()).sum()


def test_k1_and_k3_are_unbiased_and_k2_is_not():
    pi, ref = _two_distributions()
    true_kl = (pi * (pi / ref).log()).sum()  # 0.2322
    for kind in ("k1", "k3"):
        expectation = _expectation_under_pi(kind, pi, ref)
        torch.testing.assert_close(expectation, true_kl, rtol=1e-6, atol=0, msg=kind)
    assert abs(_expectation_under_pi("k2", pi, ref) - true_kl) > 1e-3


def test_k2_and_k3_are_never_negative_where_k1_is():
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(8, 16, generator=generator) * 5
    ref_logprobs = -torch.rand(8, 16, generator=generator) * 5
    mask = torch.ones(8, 16)
    assert (kl_estimate(logprobs, ref_logprobs, mask, kind="k1") < 0).any()
    for kind in ("k2", "k3"):
        assert (kl_estimate(logprobs, ref_logprobs, mask, kind=kind) >= 0).all()


@pytest.mark.parametrize(
    ("kind", "direction"),
    [("k1", None), ("k2", "reverse"), ("k3", "forward")],
)
def test_loss_gradients_match_the_module_docstring(kind, direction):
    """On-policy, grad E[k2] = grad KL(pi || ref), grad E[k3] = grad KL(ref || pi), grad E[k1] = 0."""
    _, ref = _two_distributions()
    logits = torch.tensor([1.0, 0.5, -0.2, -1.0], dtype=torch.float64, requires_grad=True)
    logprobs = logits.log_softmax(-1)
    pi = logprobs.exp().detach()  # the sampling distribution carries no gradient
    per_token = kl_estimate(logprobs[None], ref.log()[None], torch.ones(1, 4), kind=kind)[0]
    (estimator_grad,) = torch.autograd.grad((pi * per_token.double()).sum(), logits)

    if direction is None:
        torch.testing.assert_close(estimator_grad, torch.zeros(4, dtype=torch.float64))
        return
    logprobs = logits.log_softmax(-1)
    probs = logprobs.exp()
    if direction == "reverse":
        true_kl = (probs * (logprobs - ref.log())).sum()
    else:
        true_kl = (ref * (ref.log() - logprobs)).sum()
    (true_grad,) = torch.autograd.grad(true_kl, logits)
    # the estimates are computed in float32
    torch.testing.assert_close(estimator_grad, true_grad, rtol=1e-5, atol=1e-6)


def test_padding_is_zero_and_never_leaks_into_the_gradient():
    logprobs = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    ref_logprobs = torch.tensor([[-2.0, -float("inf")]])
    mask = torch.tensor([[True, False]])
    for kind in ("k1", "k2", "k3"):
        out = kl_estimate(logprobs, ref_logprobs, mask, kind=kind)
        assert out[0, 1] == 0
        (grad,) = torch.autograd.grad(out.sum(), logprobs)
        assert torch.isfinite(grad).all() and grad[0, 1] == 0, kind


def test_max_abs_estimate_caps_each_tokens_estimate_and_its_gradient():
    """The issue 16 input: x = [-3, 5, -29]. Clamping x first gave [16.1, 4.0, 22015] and a
    gradient of -19.1 at x = -3; capping the estimate gives at most 10 per token, no gradient
    where the cap holds, and the ordinary gradient below it."""
    x = torch.tensor([[-3.0, 5.0, -29.0, 0.5]], requires_grad=True)
    mask = torch.ones(1, 4)
    k3 = kl_estimate(x, torch.zeros(1, 4), mask, kind="k3", max_abs_estimate=10.0)
    expected = [10.0, math.exp(-5) - 1 + 5, 10.0, math.exp(-0.5) - 1 + 0.5]
    torch.testing.assert_close(k3, torch.tensor([expected]))
    (grad,) = torch.autograd.grad(k3.sum(), x)
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, 1 - math.exp(-5), 0.0, 1 - math.exp(-0.5)]])
    )
    assert kl_estimate(x, torch.zeros(1, 4), mask, kind="k3")[0, 2] > 1e12  # no cap: ~4e12


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_the_cap_keeps_extreme_log_ratios_finite_with_finite_gradients(kind):
    x = torch.tensor([[-1e4, -100.0, -4.5, 4.5, 100.0, 1e4]], requires_grad=True)
    out = kl_estimate(x, torch.zeros_like(x), torch.ones(1, 6), kind=kind, max_abs_estimate=10.0)
    assert out.abs().max() <= 10.0 and torch.isfinite(out).all()
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.isfinite(grad).all(), grad
    if kind == "k2":  # x^2 / 2 reaches 10 at |x| = sqrt(20) ~ 4.47
        assert (out == 10.0).all()
    if kind == "k1":
        assert out[0, 2] == -4.5 and out[0, 0] == -10.0 and out[0, 5] == 10.0
    with pytest.raises(ValueError, match="max_abs_estimate must be > 0"):
        kl_estimate(x, torch.zeros_like(x), torch.ones(1, 6), kind=kind, max_abs_estimate=0.0)


def test_kl_loss_is_the_aggregated_estimate():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.5)], [math.log(0.25), 0.0]])
    ref_logprobs = torch.tensor([[math.log(0.25), math.log(0.5)], [math.log(0.5), 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    ln2 = math.log(2)
    k3 = [(0.5 - 1) + ln2, 0.0, (2 - 1) - ln2]  # the valid tokens
    torch.testing.assert_close(
        kl_loss(logprobs, ref_logprobs, mask, kind="k3"), torch.tensor(sum(k3) / 3)
    )
    torch.testing.assert_close(
        kl_loss(logprobs, ref_logprobs, mask, kind="k3", num_tokens=6), torch.tensor(sum(k3) / 6)
    )


def test_bad_kind_and_shapes_are_errors():
    with pytest.raises(ValueError, match=r"kind must be one of \('k1', 'k2', 'k3'\), got 'k4'"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), kind="k4")
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(1, 3\)"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), kind="k1")


def test_adaptive_kl_coefficient_by_hand():
    from ferrule_trainer.kl import adapt_kl_coef

    # KL twice the target: the error is clipped to +0.2; 256 of 1000 horizon samples
    assert adapt_kl_coef(0.1, 0.02, target=0.01, horizon=1000, samples=256) == pytest.approx(
        0.1 * (1 + 0.2 * 0.256)
    )
    # KL at 90% of the target: e = -0.1
    assert adapt_kl_coef(0.1, 0.009, target=0.01, horizon=1000, samples=100) == pytest.approx(
        0.1 * (1 - 0.1 * 0.1)
    )
    assert adapt_kl_coef(0.1, 0.01, target=0.01, horizon=1000, samples=100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="target, horizon and samples > 0"):
        adapt_kl_coef(0.1, 0.01, target=0.0, horizon=1000, samples=100)
    with pytest.raises(ValueError, match=r"samples \(500\) must be below 5 x horizon \(100\)"):
        adapt_kl_coef(0.1, 0.0, target=0.01, horizon=100, samples=500)  # would give -0.1
