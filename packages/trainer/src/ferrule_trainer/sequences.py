"""The forward passes that read responses out of an RL batch (the layout of batch.py), and the
micro-batches they run in.

Micro-batches by tokens: `plan_micro_batches` sorts rows by length into groups that fit a token
budget (with `group_by_length`, which SFT, RM and DPO use too). `Batch.take` cuts a group out
without the padding its rows share, and `packed_inputs` lays a group out as one row without
padding. `forward_in_micro_batches` runs a forward over the groups and returns the results in
the batch's row order.

Token budgets give data-parallel ranks different numbers of micro-batches. Where every pass is a
collective (ZeRO-2 reduces gradients after every backward, ZeRO-3 gathers parameters in every
forward), every rank must run the same number of passes, and `most_over_ranks` gives that count.
A rank with fewer micro-batches repeats its last one, to no effect, until it has run as many
passes as the rank with the most.
"""

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from ferrule_trainer.batch import Batch
from ferrule_trainer.losses import token_entropy
from ferrule_trainer.memory import HEAD_CHUNK

# engine.compile_decoder_layers sets this on a model; response_logprobs then compiles the LM
# head's softmax.
COMPILED_HEAD = "ferrule_compiled_head"
# Compiled layers specialise on whether the length is a multiple of 8 (inductor's alignment), on
# whether there is a single row, and on whether there is an attention mask (model_inputs never
# passes one). Each new case recompiled every layer, ~9 s at 1.5B, the first time it turned up.
ALIGN = 8
# Model settings that change the logits after the LM head; such models take the whole-logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def most_over_ranks(count: int, device: torch.device) -> int:
    """The largest `count` over the ranks of the default process group (`count` itself when
    there is no group). Every rank must call it, because it is a collective."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return count
    most = torch.tensor(count, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most)


def group_by_length(
    sizes: list[tuple[int, ...]],
    *,
    max_items: int,
    max_tokens: int,
    rows_per_item: int = 1,
    packed: bool = False,
) -> list[list[int]]:
    """Groups items (sequences, or pairs of them) into micro-batches by a token budget, and
    returns each group's item indices. Items are sorted by length, longest first, and a group
    holds at most `max_items`. An item has parts (a left-padded prompt, a right-padded
    response). A group's padded size is its rows x the sum over parts of the group's longest
    such part, and it must stay within `max_tokens`. With `packed`, the group's real tokens
    (summed over its items: rows x the item's parts) must stay within the budget instead, and
    each item goes to the first group it fits in. An item over the budget goes alone.
    Sorting keeps items of similar length together, so little of the budget goes to padding."""
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
    for i in order:  # in sorted order: a new group where the next item would exceed the budget
        wider = tuple(map(max, widest, sizes[i])) if widest else sizes[i]
        rows = rows_per_item * (len(groups[-1]) + 1) if groups else 0
        if not groups or len(groups[-1]) >= max_items or rows * sum(wider) > max_tokens:
            groups.append([])
            wider = sizes[i]
        groups[-1].append(i)
        widest = wider
    return groups


def plan_micro_batches(
    batch: Batch,
    *,
    max_rows: int,
    max_tokens: int,
    packed: bool = False,
    unit: int = 1,
) -> list[list[int]]:
    """The rows of each micro-batch of `batch` under a token budget: `group_by_length` of the
    rows' prompt and response lengths, with at most `max_rows` rows per micro-batch. A group's
    padded size is the size of what `Batch.take` cuts out, and its packed size is the size of
    what `packed_inputs` lays out. Each `unit` consecutive rows stay together, in order
    (2: preference pairs)."""
    prompt, response = (x.view(-1, unit).amax(-1).clamp(min=1).tolist() for x in batch.lengths())
    groups = group_by_length(
        list(zip(prompt, response, strict=True)),
        max_items=max(max_rows // unit, 1),
        max_tokens=max_tokens,
        rows_per_item=unit,
        packed=packed,
    )
    return [[u * unit + i for u in group for i in range(unit)] for group in groups]


def forward_in_micro_batches(
    forward,
    batch: Batch,
    size: int | None,
    device: torch.device,
    max_tokens: int | None = None,
    packed: bool = False,
    lockstep: bool = False,
) -> torch.Tensor:
    """Runs `forward(micro_batch)` on `device` over micro-batches of `size` rows (None: all rows
    at once) and concatenates the results on the host. A forward's activations and logits scale
    with its rows, so a rank's whole shard at once can be far larger than the device's memory.
    With `max_tokens`, the micro-batches are `plan_micro_batches` of that budget, each trimmed
    by `Batch.take` (with `packed`, `forward` packs each one into one row). The (B, R) result
    comes back in the batch's row order, 0 on padding. With `lockstep` (ZeRO-3, whose forward
    gathers parameters from every rank), every rank of the group calls this together and runs
    as many forwards as the rank with the most."""
    rows = batch.rows
    if max_tokens is None:
        micro_batches = batch.split(size or rows)
        passes = most_over_ranks(len(micro_batches), device) if lockstep else len(micro_batches)
        parts = [forward(mb.to(device)).cpu() for mb in micro_batches]
        for _ in range(passes - len(micro_batches)):  # repeats, to keep in step with the others
            forward(micro_batches[-1].to(device))
        return torch.cat(parts)
    groups = plan_micro_batches(batch, max_rows=size or rows, max_tokens=max_tokens, packed=packed)
    passes = most_over_ranks(len(groups), device) if lockstep else len(groups)
    response_len = batch.response_len
    out = None
    for group in groups:
        part = forward(batch.take(group).to(device)).cpu()
        if out is None:
            out = part.new_zeros((rows, response_len, *part.shape[2:]))
        out[torch.tensor(group), : part.shape[1]] = part
    for _ in range(passes - len(groups)):  # repeats, to keep in step with the others
        forward(batch.take(groups[-1]).to(device))
    real = batch.attention_mask[:, -response_len:].bool()
    return torch.where(real.view(*real.shape, *[1] * (out.dim() - 2)), out, 0)


def _response_positions(batch: Batch):
    """Returns three things: every row's real tokens in order (a flat tensor, row-major: each
    row's prompt, then its response); how many real tokens each row has; and (B, R), for each
    response token, the position within its row whose output predicts it (for padding, some
    position of the row)."""
    attention = batch.attention_mask.bool()
    lengths = attention.sum(-1)
    prompt, _ = batch.lengths()
    column = torch.arange(batch.response_len, device=lengths.device)
    at = torch.minimum((prompt - 1)[:, None] + column, (lengths - 1)[:, None]).clamp(min=0)
    return batch.input_ids[attention], lengths, at


def packed_inputs(batch: Batch) -> tuple[torch.Tensor, ...]:
    """The rows of `batch` packed without padding: (1, N) input ids of every row's real tokens
    back to back, (1, N) position ids that restart at 0 with each row, and (B, R) indices into
    the N positions: for each response token, the position whose output predicts it (for
    padding, any position).

    Given position ids and no attention mask, transformers' sdpa and eager attention build a
    document mask from the restarts (`masking_utils.find_packed_sequence_indices`) and flash
    attention runs variable-length kernels, so no token attends across rows."""
    ids, lengths, at = _response_positions(batch)
    starts = lengths.cumsum(0) - lengths
    positions = torch.arange(len(ids), device=ids.device) - starts.repeat_interleave(lengths)
    return ids[None], positions[None], starts[:, None] + at


def model_inputs(model, batch: Batch, packed: bool = False) -> dict[str, torch.Tensor]:
    """The keywords of a forward over `batch`, and "index": (B, R) the positions whose output
    predicts each response token (packed: into the one row of `packed_inputs`; else into each
    row).

    When not packed, each row's real tokens start at column 0, padding follows them, and there
    is no attention mask. Under causal attention no real token sees the padding behind it, and
    positions count from 0 in every row, which is transformers' default. So sdpa runs its causal
    kernel (flash) with no mask to build or read. Batch.py's layout (prompts left-padded, so
    that the responses share columns) would need a mask, and with a mask sdpa runs a slower
    kernel: the memory-efficient one, or cuDNN's. cuDNN's kernel builds a plan for each new
    shape, and its backward put NaN into the gradients of queries that saw no key (on an H200;
    issue 56). At 1.5B, over a long-tailed step's micro-batches (~400k tokens), forward and
    backward took 9.95 s this way, against 13.3 s (cuDNN, masked) and 13.7 s
    (memory-efficient).

    For a model with compiled layers (`compiled_head`), every pass has the same form: padding
    brings the length to a multiple of ALIGN, and a single row gets a second row, all padding
    (callers keep the first `batch.rows` rows of the output)."""
    aligned = compiled_head(model)
    if packed:
        ids, positions, index = packed_inputs(batch)
        if aligned:
            tail = ALIGN - ids.shape[1] % ALIGN  # at least one column, a document of its own
            ids = F.pad(ids, (0, tail))
            positions = torch.cat([positions, torch.arange(tail, device=ids.device)[None]], 1)
        return dict(input_ids=ids, position_ids=positions, index=index)
    rows = batch.rows + 1 if aligned and batch.rows == 1 else batch.rows
    ids, index = padded_inputs(batch, ALIGN if aligned else 1, rows)
    return dict(input_ids=ids, index=index)


def padded_inputs(batch: Batch, align: int = 1, rows: int | None = None):
    """(rows, T) input ids and (B, R) indices. In the ids, each row's real tokens start at
    column 0 and padding (0) follows them. T is the longest row's length rounded up to a
    multiple of `align`, and rows past the batch's rows are all padding. The indices give, for
    each response token, the position in its row whose output predicts it."""
    tokens, lengths, index = _response_positions(batch)
    width = int(lengths.max())
    width += -width % align
    real = torch.arange(width, device=tokens.device) < lengths[:, None]
    ids = tokens.new_zeros(rows or batch.rows, width)
    ids[: batch.rows][real] = tokens
    return ids, index


def response_logits(model, batch: Batch, packed: bool = False) -> torch.Tensor:
    """(B, R, vocab) logits that predict the R response tokens. Only the positions from the
    first one read onwards go through the LM head (`logits_to_keep`), because with a 150k
    vocabulary the full logits would be the largest tensor of the step. With `packed`, this is
    one forward of `packed_inputs(batch)`, with no padding."""
    inputs = model_inputs(model, batch, packed)
    index = inputs.pop("index")
    if packed:
        output = model_forward(model, inputs, logits_to_keep=index.flatten())
        return output.logits.view(*index.shape, -1)
    first = int(index.min())
    output = model_forward(model, inputs, logits_to_keep=inputs["input_ids"].shape[1] - first)
    logits = output.logits[: batch.rows]
    return logits.gather(1, (index - first)[..., None].expand(-1, -1, logits.shape[-1]))


# The attention kernels of a training forward: all of sdpa's but cuDNN's (see model_inputs).
TRAIN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def without_cudnn():
    """A checkpoint's `context_fn`: runs both its forward and its recomputation on
    TRAIN_BACKENDS."""
    return sdpa_kernel(TRAIN_BACKENDS), sdpa_kernel(TRAIN_BACKENDS)


def model_forward(model, inputs: dict, **kwargs):
    """Runs `model(**inputs)` without a cache, with its attention on TRAIN_BACKENDS. A backward
    runs the kernels that its forward chose. Gradient checkpointing's recomputation runs after
    this returns, so it sets the backends again (`without_cudnn` in engine.load_model)."""
    with sdpa_kernel(TRAIN_BACKENDS):
        return model(**inputs, **kwargs, use_cache=False)


def response_logprobs(
    model, batch: Batch, temperature: float = 1.0, *, packed: bool = False, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) float32 log p(token) of the response tokens under softmax(logits / temperature),
    and, with `entropy`, the entropy of that softmax at each position (else None); 0 at padding.

    These are the same values as `token_logprobs(response_logits(...))`, but the logits of the
    whole pass are never held: the model runs with its LM head bypassed, and then the head runs
    on HEAD_CHUNK real response tokens at a time. With gradients on, each chunk is checkpointed:
    backward recomputes the chunk's logits (one more head matmul, ~5% of a 1.5B model's step)
    instead of keeping them, which would cost ~12 bytes x vocabulary per response token
    (1.8 MB at 151,936).
    Where `_chunkable` says no (ZeRO-3, logit softcapping), the logits are held whole."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    head = model.get_output_embeddings()
    if not _chunkable(model, head):
        logits = response_logits(model, batch, packed)
        out = token_logprobs(logits, batch.response_tokens, temperature)
        return out, token_entropy(logits.float() / temperature) if entropy else None
    with _bypassed(head):
        hidden = response_logits(model, batch, packed)  # (B, R, hidden): the head's inputs
    real = batch.attention_mask[:, -batch.response_len :].bool()
    values, entropies = chunked_head_logprobs(
        model, hidden[real], batch.response_tokens[real], temperature, entropy
    )
    logprobs = hidden.new_zeros(real.shape, dtype=torch.float32).masked_scatter(real, values)
    if not entropy:
        return logprobs, None
    return logprobs, logprobs.new_zeros(real.shape).masked_scatter(real, entropies)


def chunked_head_logprobs(model, hidden, tokens, temperature: float, entropy: bool):
    """log p(tokens) under the LM head's softmax, and the entropies (else an empty tensor),
    given the head's inputs `hidden` (N, hidden). The head runs on HEAD_CHUNK rows at a time,
    and each chunk is checkpointed while gradients are on. Where `_chunkable` says no, the head
    runs in one call and its output is kept for backward."""
    head = model.get_output_embeddings()
    if not _chunkable(model, head):
        return _head_logprobs(head, hidden, tokens, temperature, entropy)
    chunks = []
    head_logprobs = _compiled_head_logprobs() if compiled_head(model) else _head_logprobs
    for rows, targets in zip(hidden.split(HEAD_CHUNK), tokens.split(HEAD_CHUNK), strict=True):
        args = (head, rows, targets, temperature, entropy)
        # a last chunk of one token would recompile the head for that size (see ALIGN)
        logprobs_of = head_logprobs if len(rows) > 1 else _head_logprobs
        if torch.is_grad_enabled():
            chunks.append(checkpoint(logprobs_of, *args, use_reentrant=False))
        else:
            chunks.append(logprobs_of(*args))
    return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])


def _chunkable(model, head) -> bool:
    """Whether `response_logprobs` may run the LM head on its own. It may not for models that
    change the logits after the head (softcapping, scaling). Nor may it under ZeRO-3: there the
    head's weight is gathered only inside the head's own call, and when the head is frozen
    (LoRA) the recomputation of the checkpointed chunks trips over ZeRO-3's hooks. In those
    cases the logits of a pass are held whole."""
    config = getattr(model, "config", None)
    if head is None or any(getattr(config, key, None) for key in _LOGIT_TRANSFORMS):
        return False
    return not hasattr(head.weight, "ds_id")  # ZeRO-3 partitioned parameters carry ds_id


def _head_logprobs(head, rows, tokens, temperature: float, entropy: bool):
    """log p(tokens) (and the entropy) of the LM head's softmax on a chunk of rows."""
    logits = head(rows).float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = -F.cross_entropy(logits, tokens, reduction="none")
    return logprobs, token_entropy(logits) if entropy else logprobs.new_zeros(0)


@functools.cache
def _compiled_head_logprobs():
    """`_head_logprobs` through torch.compile, for models whose decoder layers are compiled
    (engine.compile_decoder_layers marks them). Run eagerly, the cast, the log-softmax and its
    gradient are each a float32 pass over [chunk, vocabulary]: ~7 GB for a 1,024-token chunk at
    a vocabulary of 151,936, counting the recomputation. Inductor fuses them around the head's
    matmul."""
    return torch.compile(_head_logprobs, dynamic=True)


def compiled_head(model) -> bool:
    """Whether `model` (or the module a DeepSpeed engine wraps) was marked COMPILED_HEAD."""
    return bool(getattr(getattr(model, "module", model), COMPILED_HEAD, False))


@contextmanager
def _bypassed(head: torch.nn.Module):
    """Inside this context `head` returns its input, so the model's forward gives the hidden
    states that the head would see, at the positions that `logits_to_keep` selects. The module
    is still called (rather than skipped), so its hooks still run, e.g. ZeRO-3's parameter
    gathering. If the instance's forward was already replaced (exact mode), that forward is put
    back afterwards."""
    own = head.__dict__.get("forward")
    head.forward = _identity
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


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


def response_values(model, batch: Batch, packed: bool = False) -> torch.Tensor:
    """(B, R) critic values: the value of the state before each response token, read at the same
    positions as the logits that predict it. `packed`: as in `response_logits`."""
    inputs = model_inputs(model, batch, packed)
    index = inputs.pop("index")
    values = model_forward(model, inputs).logits[..., 0]
    if packed:
        return values[0][index].float()
    return values[: batch.rows].gather(1, index).float()
