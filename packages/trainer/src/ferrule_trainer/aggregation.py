"""Reduce a (batch, response_len) per-token loss to the scalar that backward() sees.

    step_tokens = sum(int(mb.mask.sum()) for mb in micro_batches)   # then all-reduce over ranks
    for mb in micro_batches:
        loss = aggregate_loss(per_token, mb.mask, num_tokens=step_tokens)

The default mode, "token-mean", divides by the number of valid response tokens in the whole
optimizer step, so every token weighs the same however the step is split into micro-batches and
ranks. A mean per micro-batch would weigh the tokens of a short micro-batch more.
"""

import torch

from ferrule_trainer._checks import check_per_token, valid_tokens

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` over valid positions; padding is ignored even if it holds NaN or inf."""
    kept = torch.where(valid_tokens(mask), values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over valid positions; 0 where there are none."""
    count = valid_tokens(mask).sum() if dim is None else valid_tokens(mask).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def sequences_with_tokens(mask: torch.Tensor) -> int:
    """The number of rows of `mask` with at least one valid token. These are the sequences that
    the seq-mean modes count."""
    return int(valid_tokens(mask).any(-1).sum())


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns this micro-batch's share of the optimizer step's loss.

    With l_it the loss of token t of sequence i, m_it the mask and |o_i| = sum_t m_it:

    - "token-mean" (default; DAPO, Yu et al. 2025, "token-level policy gradient loss"):
      sum_it m_it l_it / num_tokens, num_tokens = valid tokens in the whole optimizer step.
    - "seq-mean-token-mean" (the GRPO paper, Shao et al. 2024): sum_i (sum_t m_it l_it / |o_i|)
      / num_sequences, where only sequences with a valid token count (|o_i| > 0). As in OpenRLHF
      and verl, a row without a valid token (a response masked whole) is not a sample of the
      step. Tokens of long responses weigh less; Liu et al. 2025 (Dr. GRPO) show that this
      biases training towards long wrong answers.
    - "seq-mean-token-sum": sum_it m_it l_it / num_sequences. Dr. GRPO (Liu et al. 2025) divides
      each response's token sum by one constant (the generation budget) instead of by |o_i|.
      That equals this mode divided by the constant, which the caller may apply as a loss or lr
      scale.

    num_tokens / num_sequences are the counts over every micro-batch and data-parallel rank of
    the step (an int, or a tensor after all-reduce). A sequence counts only if it has a valid
    token (`sequences_with_tokens`). When a count is None, this micro-batch's own count is used,
    which is right only when the step is this one micro-batch on one rank. Summing this function
    over the step's micro-batches and ranks gives the step's loss. Data-parallel gradient
    averaging and DeepSpeed's default division by the accumulation steps both scale that loss
    down, so the caller multiplies by (data-parallel size x accumulation steps) to undo both.
    Mode names follow verl's `loss_agg_mode`.
    """
    check_per_token(mask, per_token_loss=per_token_loss)
    valid = valid_tokens(mask)
    if mode == "token-mean":
        count = valid.sum() if num_tokens is None else num_tokens
        return masked_sum(per_token_loss, valid) / _positive(count, "num_tokens")
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        per_sequence = masked_sum(per_token_loss, valid, dim=-1)
        if mode == "seq-mean-token-mean":
            per_sequence = per_sequence / valid.sum(-1).clamp(min=1)
        count = sequences_with_tokens(valid) if num_sequences is None else num_sequences
        return per_sequence.sum() / _positive(count, "num_sequences")
    raise ValueError(f"mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def _positive(count: int | float | torch.Tensor, name: str) -> int | float | torch.Tensor:
    # A step without valid tokens has a loss of 0, not 0 / 0. A Python count is checked here;
    # a tensor count is clamped instead, since reading it would wait for the device.
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    if count < 0:
        raise ValueError(f"{name} must be the step's count (>= 0), got {count}")
    return max(count, 1)
