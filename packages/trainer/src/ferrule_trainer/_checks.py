"""Argument checks shared by the RL math modules. Each error names the argument and its shape.

Shape checks read only metadata, so they cost nothing on GPU (no device sync).
"""

import torch


def check_per_token(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Checks that `mask` is (batch, response_len) and that every given tensor has the same
    shape (tensors that are None are skipped)."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be (batch, response_len), got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but mask has shape "
                f"{tuple(mask.shape)}; per-token tensors are (batch, response_len)"
            )


def check_sequence_scores(scores: torch.Tensor, mask: torch.Tensor) -> None:
    """Checks that `scores` is (batch,), one value per row of the (batch, response_len) `mask`."""
    check_per_token(mask)
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(
            f"scores must be (batch,) = ({mask.shape[0]},) to match mask {tuple(mask.shape)}, "
            f"got shape {tuple(scores.shape)}"
        )


def check_groups(scores: torch.Tensor, group_size: int) -> None:
    """Checks that `scores` splits into contiguous groups of `group_size` samples of one prompt,
    with `group_size` >= 2."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (samples per prompt; a group of one has no "
            f"baseline), got {group_size!r}"
        )
    if scores.shape[0] % group_size:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)}: batch {scores.shape[0]} is not divisible by "
            f"group_size {group_size}; groups are contiguous runs of group_size samples"
        )


def valid_tokens(mask: torch.Tensor) -> torch.Tensor:
    """Returns the mask as bool. A float mask of 0/1 and a bool mask mean the same thing."""
    return mask if mask.dtype == torch.bool else mask != 0
