"""Advantage estimators against values worked out by hand, plus the properties they must keep."""

import math

import pytest
import torch

from ferrule_trainer.advantages import (
    discounted_returns,
    dr_grpo,
    gae,
    grpo,
    normalize_advantages,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)

NAN = float("nan")


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    gamma, lam = 0.9, 0.8
    # backwards from the last token, where V_{t+1} = 0:
    d2 = 1.0 + gamma * 0.0 - 0.7  # 0.3
    d1 = 0.0 + gamma * 0.7 - 0.6  # 0.03
    d0 = 0.0 + gamma * 0.6 - 0.5  # 0.04
    a2 = d2  # 0.3
    a1 = d1 + gamma * lam * a2  # 0.03 + 0.72 * 0.3 = 0.246
    a0 = d0 + gamma * lam * a1  # 0.04 + 0.72 * 0.246 = 0.21712
    out = gae(rewards, values, torch.ones(1, 3), gamma=gamma, lam=lam)
    close(out.advantages, [[a0, a1, a2]])
    close(out.advantages, [[0.21712, 0.246, 0.3]])
    close(out.returns, [[a0 + 0.5, a1 + 0.6, a2 + 0.7]])


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 6, generator=generator)
    values = torch.randn(4, 6, generator=generator)
    mask = torch.ones(4, 6)
    out = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(out.advantages, reward_to_go - values)
    torch.testing.assert_close(out.returns, reward_to_go)


def test_gae_lambda_zero_is_one_step_td_error():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, -1.0, 2.0]])
    out = gae(rewards, values, torch.ones(1, 3), gamma=0.5, lam=0.0)
    close(out.advantages, [[1.0 + 0.5 * -1.0 - 0.5, 2.0 + 0.5 * 2.0 + 1.0, 3.0 - 2.0]])


def test_gae_padding_never_affects_results():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.0], [0.1, 0.3, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    clean = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    garbage = gae(
        torch.where(mask.bool(), rewards, NAN),
        torch.where(mask.bool(), values, 1e30),
        mask,
        gamma=0.9,
        lam=0.8,
    )
    for a, b in zip(clean, garbage, strict=True):
        torch.testing.assert_close(a, b)
    # the padded row is the 2-token episode computed on its own
    alone = gae(rewards[:1, :2], values[:1, :2], torch.ones(1, 2), gamma=0.9, lam=0.8)
    torch.testing.assert_close(clean.advantages[:1, :2], alone.advantages)
    assert clean.advantages[0, 2] == 0 and clean.returns[0, 2] == 0


def test_gae_skips_holes_in_the_mask():
    # token 1 is tool output: the recursion steps from token 2 straight to token 0
    rewards = torch.tensor([[0.5, 7.0, 1.0]])
    values = torch.tensor([[0.2, 9.0, 0.6]])
    out = gae(rewards, values, torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8)
    a2 = 1.0 - 0.6  # 0.4
    a0 = (0.5 + 0.9 * 0.6 - 0.2) + 0.9 * 0.8 * a2  # 0.84 + 0.288 = 1.128
    close(out.advantages, [[a0, 0.0, a2]])


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5; the padded 5 is not a reward
    close(discounted_returns(rewards, mask, gamma=0.5), [[1.5, 1.0, 2.0, 0.0]])


def test_normalize_advantages_by_hand():
    advantages = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # mean 3, population std sqrt((4 + 0 + 4) / 3)
    std = math.sqrt(8 / 3)
    close(normalize_advantages(advantages, mask, eps=0.0), [[-2 / std, 0.0], [2 / std, 0.0]])


def test_reinforce_plus_plus_by_hand():
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    # the score sits on the last valid token; returns with gamma = 1: [[1, 1], [0, -]]
    # mean 2/3; population std sqrt((1/9 + 1/9 + 4/9) / 3) = sqrt(2) / 3
    s = math.sqrt(2)
    expected = [[1 / s, 1 / s], [-s, 0.0]]
    torch.testing.assert_close(reinforce_plus_plus(scores, mask), torch.tensor(expected))


def test_reinforce_plus_plus_kl_penalty_and_discount():
    scores = torch.tensor([1.0, 0.0])
    mask = torch.ones(2, 2)
    kl = torch.tensor([[0.2, 0.4], [0.0, 1.0]])
    out = reinforce_plus_plus(scores, mask, kl=kl, kl_coef=0.5, gamma=0.5)
    # token rewards [[-0.1, 1 - 0.2], [0, -0.5]]; returns [[-0.1 + 0.4, 0.8], [-0.25, -0.5]]
    returns = torch.tensor([[0.3, 0.8], [-0.25, -0.5]])
    mean = returns.mean()  # 0.0875
    std = (returns - mean).square().mean().sqrt()
    torch.testing.assert_close(out, (returns - mean) / std)


def test_reinforce_plus_plus_baseline_by_hand():
    scores = torch.tensor([1.0, 0.0, 3.0, 2.0])
    mask = torch.ones(4, 1)
    # group means 0.5 and 2.5 -> [0.5, -0.5, 0.5, -0.5]; batch mean 0, std 0.5
    out = reinforce_plus_plus_baseline(scores, mask, group_size=2)
    close(out, [[1.0], [-1.0], [1.0], [-1.0]])
    # a batch-wide mean (3/2) would have ranked the second group above the first
    assert not torch.allclose(reinforce_plus_plus(scores, mask), out)


def test_grpo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [0, 1]])
    # group 1: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    hi, lo = (2 / 3) / std, (-1 / 3) / std  # 1.1547, -0.5774
    expected = [[hi, hi], [lo, 0.0], [lo, lo], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    out = grpo(scores, mask, group_size=3, eps=0.0)
    torch.testing.assert_close(out[:3], torch.tensor(expected[:3]))
    # group 2 has equal scores: with the default eps its advantage is 0, not 0 / 0
    torch.testing.assert_close(grpo(scores, mask, group_size=3)[3:], torch.tensor(expected[3:]))


def test_dr_grpo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 4.0, 2.0, 0.0])
    mask = torch.ones(6, 1)
    # group means 1/3 and 2; no division by the std
    close(dr_grpo(scores, mask, group_size=3), [[2 / 3], [-1 / 3], [-1 / 3], [2.0], [0.0], [-2.0]])


def test_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    mask = torch.ones(6, 1)
    # each sample's baseline is the mean of the *other* samples of its group
    expected = [
        1.0 - (0.0 + 0.0) / 2,  # 1
        0.0 - (1.0 + 0.0) / 2,  # -0.5
        0.0 - (1.0 + 0.0) / 2,  # -0.5
        3.0 - (1.0 + 2.0) / 2,  # 1.5
        1.0 - (3.0 + 2.0) / 2,  # -1.5
        2.0 - (3.0 + 1.0) / 2,  # 0
    ]
    close(rloo(scores, mask, group_size=3), [[a] for a in expected])


def test_rloo_sums_to_zero_per_group_and_scales_the_centered_score():
    scores = torch.randn(20, generator=torch.Generator().manual_seed(1))
    n = 5
    advantages = rloo(scores, torch.ones(20, 1), group_size=n)[:, 0]
    torch.testing.assert_close(advantages.view(-1, n).sum(-1), torch.zeros(4))
    centered = dr_grpo(scores, torch.ones(20, 1), group_size=n)[:, 0]
    torch.testing.assert_close(advantages, centered * n / (n - 1))


@pytest.mark.parametrize("estimator", [grpo, dr_grpo, rloo, reinforce_plus_plus_baseline])
def test_group_estimators_ignore_padding_and_need_whole_groups(estimator):
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    out = estimator(scores, mask, group_size=2)
    assert out.shape == (4, 3)
    assert (out[~mask.bool()] == 0).all()
    assert out[mask.bool()].abs().sum() > 0

    with pytest.raises(ValueError, match=r"group_size 2.*\(5,\)|\(5,\).*group_size 2"):
        estimator(torch.ones(5), torch.ones(5, 3), group_size=2)
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        estimator(scores, mask, group_size=1)
    with pytest.raises(ValueError, match=r"scores must be \(batch,\).*\(4, 3\).*\(3,\)"):
        estimator(scores[:3], mask, group_size=2)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but mask has shape \(2, 3\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask must be \(batch, response_len\)"):
        reinforce_plus_plus(torch.zeros(3), torch.ones(3))


def test_advantages_never_carry_a_gradient():
    values = torch.tensor([[0.5, 0.2]], requires_grad=True)  # straight from the critic
    scores = torch.tensor([1.0, 0.0], requires_grad=True)
    mask = torch.ones(2, 2)
    assert not gae(torch.ones(1, 2), values, torch.ones(1, 2)).advantages.requires_grad
    for estimator in (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline):
        assert not estimator(scores, mask, group_size=2).requires_grad, estimator.__name__
    assert not reinforce_plus_plus(scores, mask).requires_grad


# -- all-equal groups: values that binary floats cannot hold exactly ---------------------------
# 0.1, 0.9 and 3.7 are not dyadic: the float32 mean of n copies misses the value by an ulp, and
# an estimator that divides by a ~0 spread blows that ulp up to an advantage of size ~1. The
# tests above use 0, 1, 2: exact in binary, so they could not catch it.


def test_the_issue_16_inputs_give_zero_advantages():
    ones = torch.ones(6, 2, dtype=torch.bool)
    out = reinforce_plus_plus_baseline(torch.tensor([0.9, 0.9, 0.9, 0, 0, 0]), ones, group_size=3)
    assert (out == 0).all(), out  # the old code gave +-0.749 on every token
    assert (normalize_advantages(torch.full((1, 7), 0.1), torch.ones(1, 7)) == 0).all()  # -0.427
    for value in (0.1, 3.7, -2.3, 1e-3, 12345.678):
        out = grpo(torch.full((8,), value), torch.ones(8, 1, dtype=torch.bool), group_size=8)
        assert (out == 0).all(), (value, out)  # the old code: -0.0074 at 0.1, ~0.24 at 3.7


@pytest.mark.parametrize("seed", range(50))
def test_every_group_estimator_gives_exactly_zero_on_random_all_equal_groups(seed):
    """Property: whatever the values, group size, padding and holes, equal scores carry no
    signal, so every token's advantage is exactly 0 (not merely small)."""
    g = torch.Generator().manual_seed(seed)
    group_size = int(torch.randint(2, 9, (), generator=g))
    groups = int(torch.randint(1, 6, (), generator=g))
    scale = 10 ** float(torch.empty(()).uniform_(-4, 4, generator=g))
    values = torch.randn(groups, generator=g) * scale
    scores = values.repeat_interleave(group_size)
    rows, width = groups * group_size, int(torch.randint(1, 7, (), generator=g))
    mask = torch.rand(rows, width, generator=g) < 0.7
    mask[:, 0] = True  # every row has a token; the rest has holes and padding
    for estimator in (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline):
        out = estimator(scores, mask, group_size=group_size)
        assert (out == 0).all(), (estimator.__name__, values.tolist(), group_size)
    # REINFORCE++ without a baseline: equal scores over the whole batch, no discount
    batch_equal = torch.full((rows,), float(values[0]))
    assert (reinforce_plus_plus(batch_equal, mask) == 0).all()
    advantages = torch.full((rows, width), float(values[0]))
    assert (normalize_advantages(advantages, mask) == 0).all()


@pytest.mark.parametrize("seed", range(20))
def test_ordinary_groups_move_by_less_than_4e_6_against_the_textbook_formulas(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (), generator=g))
    scores = torch.rand(4 * n, generator=g) * 3
    mask = torch.ones(4 * n, 1, dtype=torch.bool)
    grouped = scores.double().view(-1, n)
    centered = grouped - grouped.mean(-1, keepdim=True)
    textbook = {
        grpo: centered / (grouped.std(-1, keepdim=True) + 1e-6),
        dr_grpo: centered,
        rloo: grouped - (grouped.sum(-1, keepdim=True) - grouped) / (n - 1),
    }
    for estimator, expected in textbook.items():
        out = estimator(scores, mask, group_size=n)[:, 0].double()
        assert (out - expected.flatten()).abs().max() < 4e-6, estimator.__name__


def test_nearly_equal_advantages_stay_small_after_normalisation():
    """Values an ulp apart: the variance floor (eps = 1e-8) keeps the noise ~1e-4 times smaller
    than the values' spread would be after a plain division by std + eps (which gives ~1)."""
    value = torch.tensor(0.1)
    advantages = torch.stack([value, torch.nextafter(value, torch.tensor(1.0))] * 4)[None]
    out = normalize_advantages(advantages, torch.ones_like(advantages))
    assert out.abs().max() < 1e-3
