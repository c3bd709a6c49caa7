"""The preference losses against values computed by hand, at extreme scores, and on ties."""

import math

import pytest
import torch

from ferrule_trainer.pairwise import dpo_loss, reward_model_loss


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_bradley_terry_by_hand():
    out = reward_model_loss(t(2.0, 0.5), t(0.5, 2.0))
    # -log sigmoid(1.5) = log(1 + e^-1.5); the second pair ranks the wrong way round
    assert out.loss.tolist() == pytest.approx(
        [math.log1p(math.exp(-1.5)), math.log1p(math.exp(1.5))]
    )
    assert out.margin.tolist() == [1.5, -1.5] and out.correct.tolist() == [1.0, 0.0]
    with_margin = reward_model_loss(t(2.0), t(0.5), margin=t(1.0))
    assert with_margin.loss.item() == pytest.approx(0.4740769841801067)  # -log sigmoid(0.5)
    assert with_margin.margin.item() == 1.5  # the reported margin is the scores' own


def test_log_exp_is_the_same_loss_to_the_last_bit():
    chosen, rejected = torch.randn(64) * 50, torch.randn(64) * 50
    a = reward_model_loss(chosen, rejected, kind="sigmoid", margin=0.3)
    b = reward_model_loss(chosen, rejected, kind="log_exp", margin=0.3)
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("kind", ["sigmoid", "log_exp"])
def test_bradley_terry_at_extreme_scores_stays_finite(kind):
    chosen = torch.tensor([1000.0, -1000.0, 0.1 + 0.2], requires_grad=True)
    rejected = t(-1000.0, 1000.0, 0.3)
    out = reward_model_loss(chosen, rejected, kind=kind)
    out.loss.sum().backward()
    # naive log(1 + exp(2000)) is inf, and log(sigmoid(-2000)) is -inf
    assert out.loss[0].item() == 0.0 and out.loss[1].item() == 2000.0
    assert torch.isfinite(chosen.grad).all()
    assert chosen.grad.tolist()[:2] == [0.0, -1.0]
    # 0.1 + 0.2 is not 0.3 in binary: a difference of a rounding error, loss log 2 still
    assert out.loss[2].item() == pytest.approx(math.log(2))


def test_dpo_sigmoid_cdpo_and_ipo_by_hand():
    # h = (-10 - -11) - (-12 - -11) = 2
    args = t(-10.0), t(-12.0), t(-11.0), t(-11.0)
    dpo = dpo_loss(*args, beta=0.1)
    assert dpo.loss.item() == pytest.approx(0.5981388693815918)  # -log sigmoid(0.2)
    assert dpo.chosen_reward.item() == pytest.approx(0.1)
    assert dpo.rejected_reward.item() == pytest.approx(-0.1)
    assert dpo.correct.item() == 1.0
    conservative = dpo_loss(*args, beta=0.1, label_smoothing=0.1)
    # 0.9 * -log sigmoid(0.2) + 0.1 * -log sigmoid(-0.2)
    assert conservative.loss.item() == pytest.approx(0.6181388693815918)
    ipo = dpo_loss(*args, beta=0.1, kind="ipo")
    assert ipo.loss.item() == pytest.approx((2 - 1 / 0.2) ** 2)  # 9


def test_dpo_gradient_points_toward_the_chosen_response():
    chosen = torch.tensor([-5.0], requires_grad=True)
    rejected = torch.tensor([-5.0], requires_grad=True)
    loss = dpo_loss(chosen, rejected, t(-5.0), t(-5.0), beta=0.5).loss
    assert loss.item() == pytest.approx(math.log(2))  # a tie
    loss.sum().backward()
    assert chosen.grad.item() == pytest.approx(-0.25) and rejected.grad.item() == pytest.approx(
        0.25
    )


def test_dpo_at_extreme_log_ratios_stays_finite():
    policy_chosen = torch.tensor([0.0, -3000.0], requires_grad=True)
    out = dpo_loss(
        policy_chosen, t(-3000.0, 0.0), t(-1500.0, -1500.0), t(-1500.0, -1500.0), beta=1.0
    )
    out.loss.sum().backward()
    assert out.loss.tolist() == [0.0, 3000.0]
    assert torch.isfinite(policy_chosen.grad).all()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kind": "hinge"}, "kind must be one of"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
        ({"kind": "ipo", "label_smoothing": 0.1}, "IPO has none"),
    ],
)
def test_dpo_refuses_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        dpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), **options)
