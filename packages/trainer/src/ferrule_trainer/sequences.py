"""The batch layout of the RL trainer and the forward passes that read responses out of it.

A batch is a dict of tensors. Sequences are prompt + response, left-padded prompts followed by
right-padded responses (as rollout engines return them), so every response starts at the same
column, T - R:

    input_ids       (B, T)  token ids
    attention_mask  (B, T)  1 for real tokens, 0 for padding (left or right)
    response_mask   (B, R)  1 for response tokens that count in the loss

Per-token tensors (old_logprobs, advantages, values, ...) are (B, R) and line up with the last R
columns of input_ids, as in OpenRLHF's `action_mask` and the losses' `mask`.
"""

import torch
import torch.nn.functional as F


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift the prompt."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_batch(batch: dict[str, torch.Tensor], *required: str) -> int:
    """Checks the layout above and the presence of `required` per-token keys; returns R."""
    for key in ("input_ids", "attention_mask", "response_mask", *required):
        if key not in batch:
            raise ValueError(f"batch has no {key!r}; it has {sorted(batch)}")
    ids, response_mask = batch["input_ids"], batch["response_mask"]
    if ids.dim() != 2 or batch["attention_mask"].shape != ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must be (batch, seq_len) of one shape, got "
            f"{tuple(ids.shape)} and {tuple(batch['attention_mask'].shape)}"
        )
    if (
        response_mask.dim() != 2
        or response_mask.shape[0] != ids.shape[0]
        or response_mask.shape[1] >= ids.shape[1]
    ):
        raise ValueError(
            f"response_mask must be (batch, response_len) with response_len < seq_len "
            f"{ids.shape[1]}, got {tuple(response_mask.shape)}"
        )
    for key in required:
        if batch[key].shape != response_mask.shape:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(batch[key].shape)}, expected response_mask's "
                f"{tuple(response_mask.shape)}"
            )
    return response_mask.shape[1]


def split(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of at most `size` rows (every tensor of the batch is split the same way)."""
    rows = batch["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on `device` (batches travel between processes on the host)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_in_micro_batches(
    forward, batch: dict[str, torch.Tensor], size: int | None, device: torch.device
) -> torch.Tensor:
    """`forward(micro_batch)` over micro-batches of `size` rows (None: all at once) on `device`,
    concatenated on the host. A forward's activations and logits scale with its rows: a whole
    rank's shard at once can be far larger than the device."""
    parts = [
        forward(to_device(mb, device)).cpu() for mb in split(batch, size or len(batch["input_ids"]))
    ]
    return torch.cat(parts)


def response_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, R, vocab) logits that predict the R response tokens. Only the last R + 1 positions go
    through the LM head (`logits_to_keep`): with a 150k vocabulary the full logits would be the
    largest tensor of the step."""
    response_len = check_batch(batch)
    output = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids(batch["attention_mask"]),
        logits_to_keep=response_len + 1,
        use_cache=False,
    )
    return output.logits[:, :-1]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), in float32; (B, R, V), (B, R) -> (B, R).
    Cross-entropy avoids materialising a second (B, R, V) tensor of log-probabilities."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    flat = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none")
    return -flat.view(tokens.shape)


def response_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["input_ids"][:, -batch["response_mask"].shape[1] :]


def response_values(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, R) critic values: the value of the state before each response token, read at the same
    positions as the logits that predict it."""
    response_len = check_batch(batch)
    output = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids(batch["attention_mask"]),
        use_cache=False,
    )
    return output.logits[:, -response_len - 1 : -1, 0].float()
