"""The batch layout of the RL trainer and the forward passes that read responses out of it.

A batch is a dict of tensors. Sequences are prompt + response, left-padded prompts followed by
right-padded responses (as rollout engines return them), so every response starts at the same
column, T - R:

    input_ids       (B, T)  token ids
    attention_mask  (B, T)  1 for real tokens, 0 for padding (left or right)
    response_mask   (B, R)  1 for response tokens that count in the loss

Per-token tensors (old_logprobs, advantages, values, ...) are (B, R) and line up with the last R
columns of input_ids, as in OpenRLHF's `action_mask` and the losses' `mask`.

Micro-batches by tokens: `plan_micro_batches` sorts rows by length into groups within a token
budget (`group_by_length`, which SFT, RM and DPO use too), `take` cuts a group out without its
shared padding, `packed_inputs` lays a group out as one row without padding;
`forward_in_micro_batches` runs a forward over them in row order.
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


def row_lengths(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real prompt and response tokens, (B,) and (B,)."""
    response_len = batch["response_mask"].shape[1]
    attention = batch["attention_mask"]
    return attention[:, :-response_len].sum(-1), attention[:, -response_len:].sum(-1)


def group_by_length(
    sizes: list[tuple[int, ...]],
    *,
    max_items: int,
    max_tokens: int,
    rows_per_item: int = 1,
    packed: bool = False,
) -> list[list[int]]:
    """Items (sequences, or pairs of them) grouped into micro-batches by a token budget: sorted
    by length, longest first, at most `max_items` to a group, and a group's padded size, rows x
    the sum over an item's parts (a left-padded prompt, a right-padded response) of the longest
    part in the group, within `max_tokens`; `packed`: its real tokens (rows x an item's parts)
    within it, first fit. An item over the budget goes alone. Sorting keeps items of like
    length together, so little of the budget goes to padding. Returns item indices."""
    if max_tokens < 1 or max_items < 1:
        raise ValueError(f"max_tokens and max_items must be >= 1, got {max_tokens}, {max_items}")
    order = sorted(range(len(sizes)), key=lambda i: (-sum(sizes[i]), i))
    groups: list[list[int]] = []
    if packed:  # first fit, decreasing
        room: list[int] = []
        for i in order:
            size = rows_per_item * sum(sizes[i])
            fit = next(
                (g for g, left in enumerate(room) if size <= left and len(groups[g]) < max_items),
                None,
            )
            if fit is None:
                groups.append([])
                room.append(max_tokens)
                fit = len(groups) - 1
            groups[fit].append(i)
            room[fit] -= size
        return groups
    widest: tuple[int, ...] = ()
    for i in order:  # in sorted order: a new group where the next item would pass the budget
        wider = tuple(map(max, widest, sizes[i])) if widest else sizes[i]
        rows = rows_per_item * (len(groups[-1]) + 1) if groups else 0
        if not groups or len(groups[-1]) >= max_items or rows * sum(wider) > max_tokens:
            groups.append([])
            wider = sizes[i]
        groups[-1].append(i)
        widest = wider
    return groups


def plan_micro_batches(
    batch: dict[str, torch.Tensor],
    *,
    max_rows: int,
    max_tokens: int,
    packed: bool = False,
    unit: int = 1,
) -> list[list[int]]:
    """The rows of each micro-batch of `batch` (the layout above) by a token budget:
    `group_by_length` of its rows' prompt and response lengths, at most `max_rows` rows each; a
    group's padded size is what `take` cuts out, its packed size what `packed_inputs` lays out.
    `unit` rows stay together, in order (2: preference pairs)."""
    prompt, response = (x.view(-1, unit).amax(-1).clamp(min=1).tolist() for x in row_lengths(batch))
    groups = group_by_length(
        list(zip(prompt, response, strict=True)),
        max_items=max(max_rows // unit, 1),
        max_tokens=max_tokens,
        rows_per_item=unit,
        packed=packed,
    )
    return [[u * unit + i for u in group for i in range(unit)] for group in groups]


def take(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """The micro-batch of `rows`, without the columns that are padding in all of them: the
    prompt columns left of its longest prompt and the response columns right of its longest
    response (per-token tensors, (B, R), lose the same response columns)."""
    index = torch.tensor(rows, dtype=torch.long)
    prompt, response = row_lengths(
        {k: batch[k][index] for k in ("attention_mask", "response_mask")}
    )
    start = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    keep_prompt, keep_response = max(int(prompt.max()), 1), max(int(response.max()), 1)
    columns = slice(start - keep_prompt, start + keep_response)
    out = {}
    for key, value in batch.items():
        value = value[index]
        if key in ("input_ids", "attention_mask"):
            value = value[:, columns]
        elif value.dim() >= 2:  # per-token, (B, R)
            value = value[:, :keep_response]
        out[key] = value
    return out


def forward_in_micro_batches(
    forward,
    batch: dict[str, torch.Tensor],
    size: int | None,
    device: torch.device,
    max_tokens: int | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """`forward(micro_batch)` over micro-batches of `size` rows (None: all at once) on `device`,
    concatenated on the host. A forward's activations and logits scale with its rows: a whole
    rank's shard at once can be far larger than the device. With `max_tokens`, the micro-batches
    are `plan_micro_batches` of that budget (`packed`: one row each, `forward` packs it), each
    trimmed by `take`; the (B, R) result comes back in the batch's row order, 0 on padding."""
    rows = len(batch["input_ids"])
    if max_tokens is None:
        parts = [forward(to_device(mb, device)).cpu() for mb in split(batch, size or rows)]
        return torch.cat(parts)
    response_len = batch["response_mask"].shape[1]
    out = None
    for group in plan_micro_batches(
        batch, max_rows=size or rows, max_tokens=max_tokens, packed=packed
    ):
        part = forward(to_device(take(batch, group), device)).cpu()
        if out is None:
            out = part.new_zeros((rows, response_len, *part.shape[2:]))
        out[torch.tensor(group), : part.shape[1]] = part
    real = batch["attention_mask"][:, -response_len:].bool()
    return torch.where(real.view(*real.shape, *[1] * (out.dim() - 2)), out, 0)


def packed_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The rows of `batch` packed without padding: (1, N) input ids of every row's real tokens
    back to back, (1, N) position ids that restart at 0 with each row, and the (B, R) indices
    into the N positions of those whose output predicts each response token (padding: any).

    Given position ids and no attention mask, transformers' sdpa and eager attention build a
    document mask from the restarts (`masking_utils.find_packed_sequence_indices`) and flash
    attention runs variable-length kernels, so no token attends across rows."""
    attention = batch["attention_mask"].bool()
    lengths = attention.sum(-1)
    starts = lengths.cumsum(0) - lengths
    ids = batch["input_ids"][attention]  # row-major: each row's prompt, then its response
    positions = torch.arange(len(ids), device=ids.device) - starts.repeat_interleave(lengths)
    prompt, _ = row_lengths(batch)
    response_len = batch["response_mask"].shape[1]
    column = torch.arange(response_len, device=ids.device)
    index = (starts + prompt - 1)[:, None] + column
    index = torch.minimum(index, (starts + lengths - 1)[:, None]).clamp(min=0)
    return ids[None], positions[None], index


def response_logits(model, batch: dict[str, torch.Tensor], packed: bool = False) -> torch.Tensor:
    """(B, R, vocab) logits that predict the R response tokens. Only the last R + 1 positions go
    through the LM head (`logits_to_keep`): with a 150k vocabulary the full logits would be the
    largest tensor of the step. `packed`: one forward of `packed_inputs(batch)`, no padding."""
    response_len = check_batch(batch)
    if packed:
        ids, positions, index = packed_inputs(batch)
        output = model(
            input_ids=ids, position_ids=positions, logits_to_keep=index.flatten(), use_cache=False
        )
        return output.logits.view(*index.shape, -1)
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


def response_values(model, batch: dict[str, torch.Tensor], packed: bool = False) -> torch.Tensor:
    """(B, R) critic values: the value of the state before each response token, read at the same
    positions as the logits that predict it. `packed`: as `response_logits`."""
    response_len = check_batch(batch)
    if packed:
        ids, positions, index = packed_inputs(batch)
        output = model(input_ids=ids, position_ids=positions, use_cache=False)
        return output.logits[0, :, 0][index].float()
    output = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids(batch["attention_mask"]),
        use_cache=False,
    )
    return output.logits[:, -response_len - 1 : -1, 0].float()
