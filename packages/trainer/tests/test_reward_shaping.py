"""Reward normalisation, clipping and per-token rewards (the KL penalty) by hand."""

import math

import pytest
import torch

from ferrule_trainer.reward_shaping import (
    RunningMoments,
    clip_rewards,
    normalize_rewards,
    token_rewards,
    update_moments,
)


def test_token_rewards_place_the_score_and_the_kl_penalty():
    scores = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, float("nan")], [0.3, 0.0, 0.1]])
    expected = [
        [-0.5 * 0.1, 1.0 - 0.5 * 0.2, 0.0],
        [-0.5 * 0.3, 0.0, 2.0 - 0.5 * 0.1],
    ]
    out = token_rewards(scores, mask, kl=kl, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor(expected))
    # without a penalty only the score remains
    torch.testing.assert_close(
        token_rewards(scores, mask), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    )


def test_token_rewards_use_the_last_valid_token_even_with_holes():
    out = token_rewards(torch.tensor([3.0]), torch.tensor([[1, 1, 0, 1, 0, 0]]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0, 3.0, 0.0, 0.0]]))


def test_token_rewards_errors():
    with pytest.raises(ValueError, match=r"rows without a valid token: \[1\]"):
        token_rewards(torch.ones(2), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"kl has shape \(2, 3\) but mask has shape \(2, 2\)"):
        token_rewards(torch.ones(2), torch.ones(2, 2), kl=torch.zeros(2, 3), kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        token_rewards(torch.ones(2), torch.ones(2, 2), kl=torch.zeros(2, 2), kl_coef=-0.1)


def test_running_moments_by_hand_and_for_any_split():
    moments = update_moments(RunningMoments(), torch.tensor([1.0, 2.0, 3.0]))
    assert moments == pytest.approx(RunningMoments(3, 2.0, 2 / 3))
    moments = update_moments(moments, torch.tensor([4.0, 5.0]))
    # 1..5: mean 3, population variance (4 + 1 + 0 + 1 + 4) / 5 = 2
    assert moments == pytest.approx(RunningMoments(5, 3.0, 2.0))

    data = torch.randn(100, generator=torch.Generator().manual_seed(0)) * 3 + 7
    split = RunningMoments()
    for chunk in data.split([1, 30, 0, 69]):
        split = update_moments(split, chunk)
    whole = update_moments(RunningMoments(), data)
    assert split == pytest.approx(whole)
    assert whole == pytest.approx((100, data.mean().item(), data.var(correction=0).item()))


def test_normalize_rewards_by_hand():
    scores = torch.tensor([1.0, 2.0, 3.0])
    std = math.sqrt(2 / 3)  # population std of the batch
    torch.testing.assert_close(normalize_rewards(scores), torch.tensor([-1 / std, 0.0, 1 / std]))
    moments = RunningMoments(count=10, mean=2.0, var=4.0)
    torch.testing.assert_close(
        normalize_rewards(scores, moments=moments), torch.tensor([-0.5, 0.0, 0.5])
    )
    with pytest.raises(ValueError, match="count 0"):
        normalize_rewards(scores, moments=RunningMoments())


def test_clip_rewards():
    scores = torch.tensor([-7.0, 0.5, 12.0])
    torch.testing.assert_close(
        clip_rewards(scores, low=-5.0, high=10.0), torch.tensor([-5.0, 0.5, 10.0])
    )
    with pytest.raises(ValueError, match="low < high"):
        clip_rewards(scores, low=1.0, high=1.0)


def test_equal_scores_normalise_to_exactly_zero_and_ulp_spreads_stay_small():
    assert (normalize_rewards(torch.full((7,), 0.1)) == 0).all()  # naive: (ulp / 1e-8) ~ 1
    value = torch.tensor(0.7)
    nearly = torch.stack([value, torch.nextafter(value, torch.tensor(1.0))] * 3)
    assert normalize_rewards(nearly).abs().max() < 1e-3
    moments = update_moments(RunningMoments(), torch.full((5,), 0.1))
    assert normalize_rewards(torch.full((5,), 0.1), moments=moments).abs().max() < 1e-3


def test_shape_scores_running_batch_and_clip():
    from ferrule_trainer.reward_shaping import shape_scores

    first, second = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([3.0, 3.0, 5.0, 5.0])
    out, moments = shape_scores(first, RunningMoments(), norm="running", clip=None)
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 1.0, -1.0]))
    out, moments = shape_scores(second, moments, norm="running", clip=1.5)
    both = torch.cat([first, second])  # running: every score so far, this batch's included
    assert moments.count == 8 and moments.mean == pytest.approx(float(both.mean()))
    expected = ((second - both.mean()) / both.std(correction=0)).clamp(-1.5, 1.5)
    torch.testing.assert_close(out, expected)
    out, same = shape_scores(second, moments, norm="batch", clip=None)
    torch.testing.assert_close(out, torch.tensor([-1.0, -1.0, 1.0, 1.0]))
    assert same == moments  # "batch" leaves the running moments alone
    out, _ = shape_scores(second, moments, norm="none", clip=4.0)
    torch.testing.assert_close(out, torch.tensor([3.0, 3.0, 4.0, 4.0]))


def test_overlong_penalty_by_hand():
    from ferrule_trainer.reward_shaping import overlong_penalty

    lengths = torch.tensor([3, 12, 13, 14, 16, 20])
    # max_tokens 16, buffer 4: the ramp starts after 12 tokens and reaches -factor at 16
    out = overlong_penalty(lengths, max_tokens=16, buffer=4, factor=0.5)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match=r"buffer must be in \(0, max_tokens = 16\], got 17"):
        overlong_penalty(lengths, max_tokens=16, buffer=17)
