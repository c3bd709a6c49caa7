"""Sequence parallelism (the DeepSpeed-Ulysses layout): the N ranks of a sequence group share
every sequence of their batch, and each rank runs the model on 1/N of each sequence's positions.

    group = SequenceGroup.split(2)       # every rank calls it; ranks 0-1, 2-3, ... form groups
    install(model, group)                # the model's attention now spans the group
    logprobs, _ = response_logprobs(model, batch, temperature=1.0, group=group)

Every rank of a group holds the same batch. Embeddings, norms, MLPs and the LM head work per
position, so each rank runs them on its own contiguous slice of the columns; those positions keep
their global position ids. Attention needs every position. In each layer, an all-to-all turns
(all heads, the rank's 1/N of the positions) into (1/N of the heads, all positions). The rank
then attends over the whole sequence with its heads, and a second all-to-all turns the result
back. Activations, the largest use of memory for a long sequence, are 1/N per rank of what one
rank alone would hold. Each layer sends 4 activations' worth of 1/N of the sequence to the other
ranks.

Why this layout rather than ring attention: it uses any attention kernel unchanged (sdpa here),
it needs no per-block softmax rescaling, and it communicates with two all-to-alls per layer
instead of N - 1 ring steps. The cost is that the number of heads (after the key/value heads are
repeated) must divide by N. Padded rows use sdpa's causal kernels; in them each row's tokens
start at column 0 and padding follows (`sequences.padded_inputs`). Packed rows need a mask of the
whole sequence, T x T booleans, and so use sdpa's memory-efficient kernel; at tens of thousands
of tokens this costs memory that the memory plan does not count.

Each rank computes the response log-probabilities at its own positions. They are gathered so
that every rank of the group holds all of them, and every rank computes the same loss from them.
The gather's backward keeps only the rank's own slice of the gradient, so the ranks together
backpropagate one copy of the loss: the sum of the group's parameter gradients over its ranks is
the gradient of the group's batch, as one rank would compute it. DeepSpeed then averages
gradients over all ranks, the other groups' included. So callers count each group's tokens once
(`engine.global_sum` / N) and leave the loss's world-size factor as it is.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ferrule_trainer.batch import Batch

ATTENTION = "ferrule_sequence_parallel"
"""The attention implementation name that `install` registers with transformers and sets on
the model whose sequences it splits over a group."""
_GROUPS: dict[int, "SequenceGroup"] = {}  # id(model config) -> the group `install` set


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks that share each sequence: there are `size` of them, and this process is rank
    `rank` among them."""

    size: int
    rank: int
    group: object  # a torch.distributed process group

    @classmethod
    def split(cls, size: int) -> "SequenceGroup":
        """Splits the whole world into groups of `size` consecutive ranks and returns this rank's
        group. Every rank must call it, because creating a process group is a collective."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if size < 1 or world % size:
            raise ValueError(f"sequence_parallel = {size} does not divide the {world} ranks")
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = group
        return cls(size, rank % size, mine)


def check_model(config, size: int) -> None:
    """Refuses a model whose attention heads cannot be split over `size` ranks."""
    heads = config.num_attention_heads
    if heads % size:
        raise ValueError(
            f"sequence_parallel = {size}: the model's {heads} attention heads must divide by it "
            "(each rank attends with heads / sequence_parallel of them over the whole sequence)"
        )
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sequence_parallel does not support sliding-window attention")
    from ferrule_trainer.sequences import _LOGIT_TRANSFORMS

    changed = [key for key in _LOGIT_TRANSFORMS if getattr(config, key, None)]
    # Each rank runs the LM head apart from the model, as a plain linear layer on its own
    # positions, so a transform of the logits after the head would not be applied.
    if changed:
        raise ValueError(
            f"sequence_parallel does not support a model whose logits {changed[0]} changes"
        )


def response_logprobs(
    model,
    batch: Batch,
    temperature: float,
    group: SequenceGroup,
    *,
    packed: bool = False,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns what `sequences.response_logprobs` returns: (B, R) tensors, the same on every
    rank of `group`. Each rank runs the model on 1/N of the positions, of the padded rows or,
    with `packed`, of the rows packed into one."""
    from ferrule_trainer.sequences import _bypassed, chunked_head_logprobs

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shards = _Shards(batch, group, packed)
    head = model.get_output_embeddings()
    with _bypassed(head):
        hidden = shards.forward(model)  # the head's inputs
    local = shards.needed_here
    values, entropies = chunked_head_logprobs(
        model, hidden[local], shards.targets_here[local], temperature, entropy
    )
    return shards.gathered(values), shards.gathered(entropies) if entropy else None


def response_values(model, batch: Batch, group: SequenceGroup, *, packed: bool = False):
    """Returns what `sequences.response_values` returns for a critic: (B, R) values, 0 at
    padding, the same on every rank of `group`."""
    shards = _Shards(batch, group, packed)
    values = shards.forward(model)[..., 0]  # the value head has one label
    return shards.gathered(values[shards.needed_here].float())


class _Shards:
    """A batch laid out for a sequence group. It holds the ids, positions and mask of the whole
    sequence; `index`, the positions (into the flattened rows) whose output is read for each
    response token; and `mine`, this rank's slice of the columns."""

    def __init__(self, batch: Batch, group: SequenceGroup, packed: bool):
        from ferrule_trainer.sequences import packed_inputs, padded_inputs

        device = batch.input_ids.device
        if packed:
            ids, positions, index = packed_inputs(batch)
            self.ids, self.positions, self.mask = _packed_to(group.size, ids, positions)
        else:  # each row's tokens start at column 0, so causal attention needs no mask
            self.ids, index = padded_inputs(batch, align=group.size)
            self.positions = torch.arange(self.ids.shape[1], device=device).expand_as(self.ids)
            self.mask = None
            index = index + (torch.arange(batch.rows, device=device) * self.ids.shape[1])[:, None]
        length = self.ids.shape[1]
        self.index, self.group = index, group
        width = length // group.size
        self.mine = slice(group.rank * width, (group.rank + 1) * width)
        needed = torch.zeros(self.ids.numel(), dtype=torch.bool, device=device)
        needed = needed.scatter_(0, index.flatten(), True).view(self.ids.shape)
        self.needed_here = needed[:, self.mine]  # where the head's output is read
        self.targets_here = self.ids.roll(-1, dims=1)[:, self.mine]  # p predicts token p + 1
        self.real = batch.attention_mask[:, -batch.response_len :].bool()

    def forward(self, model) -> torch.Tensor:
        """The model's output at this rank's positions, (rows, width, ...). `install` must have
        given the model this group's attention."""
        from ferrule_trainer.sequences import model_forward

        inputs = dict(
            input_ids=self.ids[:, self.mine],
            position_ids=self.positions[:, self.mine],
            attention_mask=self.mask,
        )
        return model_forward(model, inputs).logits

    def gathered(self, needed_values: torch.Tensor) -> torch.Tensor:
        """Gathers every rank's values at its needed positions into one (B, R) tensor, 0 at
        padding."""
        placed = needed_values.new_zeros(self.needed_here.shape, dtype=torch.float32)
        placed = placed.masked_scatter(self.needed_here, needed_values.float())
        whole = _GatherColumns.apply(placed, self.group)  # (rows, T)
        picked = whole.flatten()[self.index.flatten()].view(self.real.shape)
        return torch.where(self.real, picked, 0.0)


def _packed_to(size: int, ids, positions):
    """Pads packed ids and positions on the right to a multiple of `size` columns; the added
    columns form a document of their own (as sequences.ALIGN's padding does). Also returns the
    (1, 1, T, T) boolean mask of the whole sequence. The mask is causal within each document,
    and a new document starts wherever the positions restart."""
    extra = -ids.shape[1] % size
    ids = F.pad(ids, (0, extra))
    positions = torch.cat([positions, torch.arange(extra, device=ids.device)[None]], 1)
    length = ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    document = (positions == 0).cumsum(-1)
    same = document[:, :, None] == document[:, None, :]
    return ids, positions, (causal & same)[:, None]


class _GatherColumns(torch.autograd.Function):
    """(rows, T / N) on each rank -> (rows, T), the ranks' slices side by side. Backward keeps
    only this rank's slice of the gradient: every rank computes the same loss from the gathered
    tensor, so the group backpropagates that loss once (see the module docstring)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.rank, ctx.width = group.rank, local.shape[1]
        parts = [torch.empty_like(local) for _ in range(group.size)]
        dist.all_gather(parts, local.contiguous(), group=group.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.width
        return grad[:, start : start + ctx.width].contiguous(), None


def install(model, group: SequenceGroup) -> None:
    """Replaces every attention of `model` with `_attention` over `group`, permanently. A `with`
    block would not do: a checkpointed layer runs its forward again in backward, after any
    `with` block around the forward has ended. Refuses a model whose heads do not split over the
    group (`check_model`)."""
    from transformers import AttentionInterface, PretrainedConfig

    AttentionInterface.register(ATTENTION, _attention)
    configs = {}  # of the model and any sub-model (a peft wrapper's is the base model's)
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs[id(config)] = config
    for key, config in configs.items():
        check_model(config, group.size)
        config._attn_implementation = ATTENTION
        _GROUPS[key] = group


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An attention function with transformers' signature. query is (B, H, T / N, D), and key
    and value are (B, KV, T / N, D), all at this rank's positions. attention_mask is the whole
    sequence's (B, 1, T, T) mask, or None for causal attention. Returns (B, T / N, H, D) and no
    weights."""
    group = _GROUPS[id(module.config)]
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:  # repeat the key/value heads to the query heads, so that all split by N
        key, value = (x.repeat_interleave(repeats, dim=1) for x in (key, value))
    query, key, value = (_heads_to_positions(x, group) for x in (query, key, value))
    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout if module.training else 0.0,
        is_causal=attention_mask is None,
        scale=scaling,
    )
    return _positions_to_heads(output, group).transpose(1, 2).contiguous(), None


def _heads_to_positions(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """(B, H, T / N, D), all heads of this rank's positions -> (B, H / N, T, D), this rank's
    heads of all positions."""
    b, h, width, d = x.shape
    n = group.size
    pieces = x.reshape(b, n, h // n, width, d).transpose(0, 1).contiguous()  # piece j: to rank j
    received = _AllToAll.apply(pieces, group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * width, d)  # rank j's positions


def _positions_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The inverse of `_heads_to_positions`."""
    b, h, length, d = x.shape
    n = group.size
    pieces = x.reshape(b, h, n, length // n, d).permute(2, 0, 1, 3, 4).contiguous()
    received = _AllToAll.apply(pieces, group)
    return received.transpose(0, 1).reshape(b, n * h, length // n, d)  # rank j's heads


class _AllToAll(torch.autograd.Function):
    """Sends piece j of dim 0 to rank j of the group; piece i of the result comes from rank i.
    The backward is the same exchange of the gradients (torch's differentiable all-to-all is
    deprecated in 2.13)."""

    @staticmethod
    def forward(ctx, pieces: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.group = group
        return _exchanged(pieces, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchanged(grad, ctx.group), None


def _exchanged(pieces: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    pieces = pieces.contiguous()  # a gradient may arrive strided; the exchange reads memory
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group.group)
    return received
