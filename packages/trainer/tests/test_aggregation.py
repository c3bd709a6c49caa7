"""Loss aggregation modes by hand, and the reason for the global token count: micro-batching."""

import pytest
import torch

from ferrule_trainer.aggregation import (
    LOSS_AGG_MODES,
    aggregate_loss,
    masked_mean,
    sequences_with_tokens,
)
from ferrule_trainer.losses import policy_loss

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_modes_by_hand():
    # 4 valid tokens summing to 10; sequence sums 6 and 4, sequence means 2 and 4
    expected = {
        "token-mean": 10 / 4,
        "seq-mean-token-mean": (2 + 4) / 2,
        "seq-mean-token-sum": 10 / 2,
    }
    for mode, value in expected.items():
        torch.testing.assert_close(aggregate_loss(PER_TOKEN, MASK, mode=mode), torch.tensor(value))
    assert set(expected) == set(LOSS_AGG_MODES)


def test_the_seq_mean_modes_leave_out_rows_without_a_valid_token():
    """Issue 59, item 9: a response masked whole is no sequence of the step (as in OpenRLHF and
    verl); counted, it shrank the loss of "seq-mean-token-mean" by up to half."""
    per_token = torch.cat([PER_TOKEN, torch.tensor([[5.0, 6.0, 7.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    assert sequences_with_tokens(mask) == 2
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        torch.testing.assert_close(
            aggregate_loss(per_token, mask, mode=mode), aggregate_loss(PER_TOKEN, MASK, mode=mode)
        )


def test_global_counts_replace_the_local_ones():
    torch.testing.assert_close(aggregate_loss(PER_TOKEN, MASK, num_tokens=8), torch.tensor(10 / 8))
    torch.testing.assert_close(
        aggregate_loss(PER_TOKEN, MASK, num_tokens=torch.tensor(20)), torch.tensor(10 / 20)
    )
    torch.testing.assert_close(
        aggregate_loss(PER_TOKEN, MASK, mode="seq-mean-token-sum", num_sequences=5),
        torch.tensor(10 / 5),
    )


def test_bool_and_float_masks_agree():
    for mode in LOSS_AGG_MODES:
        torch.testing.assert_close(
            aggregate_loss(PER_TOKEN, MASK.bool(), mode=mode),
            aggregate_loss(PER_TOKEN, MASK.float(), mode=mode),
        )


def test_two_micro_batches_with_global_counts_equal_one_batch():
    """Gradient accumulation over micro-batches must give the full batch's gradient."""
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(4, 6, generator=generator)).requires_grad_()
    old_logprobs = logprobs.detach() + 0.1 * torch.randn(4, 6, generator=generator)
    advantages = torch.randn(4, 6, generator=generator)
    # lengths 6 and 5 in the first micro-batch, 1 and 2 in the second
    mask = torch.tensor([[1] * 6, [1] * 5 + [0], [1] + [0] * 5, [1, 1] + [0] * 4])
    halves = [slice(0, 2), slice(2, 4)]

    def grad_of(loss):
        (grad,) = torch.autograd.grad(loss, logprobs)
        return grad

    args = (logprobs, old_logprobs, advantages, mask)
    counts = {"num_tokens": int(mask.sum()), "num_sequences": 4}
    for mode in LOSS_AGG_MODES:
        whole = policy_loss(*args, agg_mode=mode).loss
        accumulated = sum(
            policy_loss(*(a[h] for a in args), agg_mode=mode, **counts).loss for h in halves
        )
        torch.testing.assert_close(accumulated, whole, msg=mode)
        torch.testing.assert_close(grad_of(accumulated), grad_of(whole), msg=mode)

    # A mean per micro-batch weighs the 3 tokens of the short micro-batch like the 11 of the other.
    per_micro_batch = sum(policy_loss(*(a[h] for a in args)).loss for h in halves) / 2
    whole = policy_loss(*args).loss
    assert not torch.allclose(per_micro_batch, whole)


def test_empty_masks_give_zero_not_nan():
    zeros = torch.zeros(2, 3)
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(PER_TOKEN, zeros, mode=mode) == 0
    assert aggregate_loss(PER_TOKEN, zeros, num_tokens=torch.tensor(0)) == 0
    assert masked_mean(PER_TOKEN, zeros) == 0


def test_aggregation_errors():
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'mean'"):
        aggregate_loss(PER_TOKEN, MASK, mode="mean")
    with pytest.raises(ValueError, match="num_tokens must be the step's count"):
        aggregate_loss(PER_TOKEN, MASK, num_tokens=-1)
    with pytest.raises(ValueError, match=r"per_token_loss has shape \(2, 2\)"):
        aggregate_loss(PER_TOKEN[:, :2], MASK)
