"""Truncated IS and IcePop weights by hand, and what they do to the policy gradient."""

import math

import pytest
import torch

from ferrule_trainer.importance import icepop_weights, truncated_is_weights
from ferrule_trainer.losses import policy_loss


def _logprobs_with_ratios(ratios):
    """(trainer, rollout) log-probabilities whose ratio trainer / rollout is `ratios`."""
    rollout = torch.full((1, len(ratios)), math.log(0.2))
    return rollout + torch.tensor([ratios]).log(), rollout


def test_truncated_is_by_hand():
    trainer, rollout = _logprobs_with_ratios([0.5, 1.0, 3.0, 1.5])
    out = truncated_is_weights(trainer, rollout, torch.ones(1, 4), cap=2.0)
    torch.testing.assert_close(out.weights, torch.tensor([[0.5, 1.0, 2.0, 1.5]]))
    torch.testing.assert_close(out.fraction, torch.tensor(1 / 4))


def test_icepop_by_hand():
    trainer, rollout = _logprobs_with_ratios([0.4, 1.0, 3.0, 6.0, 0.5, 5.0])
    out = icepop_weights(trainer, rollout, torch.ones(1, 6), low=0.5, high=5.0)
    # outside [0.5, 5] -> 0; inside (bounds included) -> the ratio itself
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 1.0, 3.0, 0.0, 0.5, 5.0]]))
    torch.testing.assert_close(out.fraction, torch.tensor(2 / 6))


@pytest.mark.parametrize("correction", [truncated_is_weights, icepop_weights])
def test_weights_are_constants_and_zero_on_padding(correction):
    trainer, rollout = _logprobs_with_ratios([0.1, 1.2, 1.0])
    trainer.requires_grad_()
    mask = torch.tensor([[1, 1, 0]])
    rollout = torch.where(mask.bool(), rollout, -float("inf"))  # what vLLM never produced
    out = correction(trainer, rollout, mask)
    assert not out.weights.requires_grad
    assert out.weights[0, 2] == 0 and torch.isfinite(out.weights).all()
    # the padded token is not counted: of the 2 valid tokens IcePop masks one (ratio 0.1),
    # TIS truncates none
    expected_fraction = 0.0 if correction is truncated_is_weights else 0.5
    torch.testing.assert_close(out.fraction, torch.tensor(expected_fraction))


def test_icepop_masked_tokens_get_no_policy_gradient():
    trainer, rollout = _logprobs_with_ratios([0.1, 1.2, 8.0])
    weights = icepop_weights(trainer, rollout, torch.ones(1, 3)).weights
    logprobs = trainer.clone().requires_grad_()
    loss = policy_loss(
        logprobs, trainer, torch.ones(1, 3), torch.ones(1, 3), is_weights=weights
    ).loss
    (grad,) = torch.autograd.grad(loss, logprobs)
    # on-policy ratio 1, A = 1: d(-w r A / 3) / d logprob = -w / 3, and w = 0 where masked
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.2 / 3, 0.0]]))


def test_correction_argument_errors():
    trainer, rollout = _logprobs_with_ratios([1.0])
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(trainer, rollout, torch.ones(1, 1), cap=0.0)
    with pytest.raises(ValueError, match="0 <= low < high"):
        icepop_weights(trainer, rollout, torch.ones(1, 1), low=2.0, high=1.0)
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(1, 2\)"):
        icepop_weights(trainer, torch.zeros(1, 2), torch.ones(1, 1))


def test_truncated_is_with_a_floor_by_hand():
    trainer, rollout = _logprobs_with_ratios([0.05, 1.0, 3.0, 0.5])
    out = truncated_is_weights(trainer, rollout, torch.ones(1, 4), cap=2.0, floor=0.1)
    torch.testing.assert_close(out.weights, torch.tensor([[0.1, 1.0, 2.0, 0.5]]))
    torch.testing.assert_close(out.fraction, torch.tensor(2 / 4))  # below the floor, above the cap
    with pytest.raises(ValueError, match=r"floor must be in \[0, cap = 2.0\), got 2.0"):
        truncated_is_weights(trainer, rollout, torch.ones(1, 4), cap=2.0, floor=2.0)


def test_sequence_mask_keeps_responses_by_their_geometric_mean_ratio():
    from ferrule_trainer.importance import sequence_mask

    rows = [[2.0, 0.5, 1.0], [3.0, 3.0, 1.0], [0.2, 1.0, 1.0], [1.0, 9.0, 9.0]]
    trainer = torch.log(torch.tensor(rows)) + math.log(0.3)
    rollout = torch.full((4, 3), math.log(0.3))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])  # padding ignored
    # geometric means: 1.0; 3.0 (over 2 tokens); 0.2^(1/3) = 0.585; 1.0 (the 9s are padding)
    keep = sequence_mask(trainer, rollout, mask, low=0.6, high=2.0)
    assert keep.tolist() == [True, False, False, True]
    assert sequence_mask(trainer, rollout, mask, low=0.5, high=3.5).all()
    with pytest.raises(ValueError, match="0 <= low < 1 < high"):
        sequence_mask(trainer, rollout, mask, low=1.0, high=2.0)
