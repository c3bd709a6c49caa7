"""Exact mode: numerics that do not depend on the batch. A token's logits are then the same bits
whether the engine computes them a step at a time (KV cache, any batch, any neighbours) or the
trainer computes them in one teacher-forced forward over a padded batch.

    exact = ExactNumerics(key_slots=1024)
    exact.apply(model)     # the engine's model and the trainer's, before either runs

Why they usually differ: a GEMM or a reduction picks its kernel from the whole shape, and the
kernel fixes the order of its additions. The shapes differ between the two sides. Decode
multiplies `rows` tokens, and the trainer multiplies B x T. Decode attends one query to a slab of
slots, and the trainer attends T queries to T keys. Left padding also puts a sequence's tokens at
different columns. So here every such operation runs on fixed shapes. The rest (embeddings,
rotary, activations, residuals) is already per element:
- linear layers and norms run on chunks of ROWS token rows (the last chunk padded with zeros);
- attention runs one (sequence, KV head, query position) row at a time, in chunks of ROWS rows.
  Each row attends to its sequence's keys, moved to slots 0.. and padded to the fixed
  `key_slots`, so that a softmax always sums over the same slots in the same order.
Both sides must use the same `key_slots`, dtype and weights. Sampling must not reshape the
distribution (no top-k / top-p), since the trainer scores the policy's own softmax.

The trainer's attention backward runs PyTorch's sdpa on the same inputs. Gradients need only be
correct, and this way the exact forward's per-chunk tensors need not be kept for the backward.
The backward uses sdpa's math kernel, whose result does not change from run to run (the fused
kernels' results do change on a GPU), so a run repeats itself bit for bit. The math kernel holds
T x T scores for one layer at a time.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ROWS = 256  # rows per fixed-shape call: one chunk holds a decode step of up to 256 sequences
ATTENTION = "ferrule_exact"  # the trainer's side: any padding, keys moved to slots 0..
SLAB_ATTENTION = "ferrule_exact_slab"  # the engine's side: keys are already at slots 0..
SLOT_ALIGN = 64


class ExactNumerics:
    """The fixed shapes both sides agree on (see the module docstring)."""

    def __init__(self, key_slots: int):
        if not isinstance(key_slots, int) or key_slots < 1:
            raise ValueError(f"key_slots must be a positive int, got {key_slots!r}")
        self.key_slots = -(-key_slots // SLOT_ALIGN) * SLOT_ALIGN

    def apply(self, model: nn.Module, slab: bool = False) -> nn.Module:
        """Route `model`'s linear layers, norms and attention through the fixed-shape versions,
        in place, and return the model. Set `slab` for the engine's decode, whose cache already
        holds every sequence's keys at slots 0..key_slots-1."""
        register()
        for module in model.modules():
            if _row_wise(module) and not hasattr(module, "_exact_forward"):
                module._exact_forward = module.forward
                module.forward = _fixed_rows(module._exact_forward)
            if type(module).__name__.endswith("Attention"):
                module.exact_key_slots = self.key_slots
        model.set_attn_implementation(SLAB_ATTENTION if slab else ATTENTION)
        return model


def _row_wise(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def _fixed_rows(forward):
    """`forward` of a row-wise module, run on chunks of exactly ROWS rows."""

    def run(x, *args, **kwargs):
        flat = x.reshape(-1, x.shape[-1])
        chunks = list(flat.split(ROWS))
        short = ROWS - chunks[-1].shape[0]
        if short:  # only the last chunk is copied (the others are views)
            chunks[-1] = torch.cat([chunks[-1], chunks[-1].new_zeros(short, flat.shape[-1])])
        out = torch.cat([forward(chunk, *args, **kwargs) for chunk in chunks])
        return out[: flat.shape[0]].reshape(*x.shape[:-1], out.shape[-1])

    return run


def register() -> None:
    """Make both attention names known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def boolean_mask(*args, **kwargs):  # always a 4D boolean mask, never None ("use is_causal")
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, exact_attention)
    AttentionInterface.register(SLAB_ATTENTION, slab_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, boolean_mask)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SLAB_ATTENTION, boolean_mask)


def _keep(mask, query, key) -> torch.Tensor:
    """[B, Tq, Tk] booleans: which keys each query sees (HF's 4D masks, boolean or additive)."""
    if mask is None:
        tq, tk = query.shape[2], key.shape[2]
        causal = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        return causal.expand(query.shape[0], tq, tk)
    mask = mask[:, 0]
    return mask if mask.dtype == torch.bool else mask == 0


def slab_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    """The engine's side: keys and values are the slab's rows, [B, KV, key_slots, D], with each
    sequence's tokens at slots 0.. (the exact decoder never left-pads)."""
    slots = module.exact_key_slots
    if key.shape[2] != slots:
        raise RuntimeError(f"the exact slab has {key.shape[2]} slots, expected {slots}")
    return _attend(query, key, value, _keep(attention_mask, query, key), scaling), None


def exact_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    """The trainer's side: [B, H, T, D] queries over [B, KV, T, D] keys with any left and right
    padding. Each sequence's keys are first moved to slots 0.. and padded out to key_slots."""
    keep = _keep(attention_mask, query, key)
    slots, length = module.exact_key_slots, key.shape[2]
    if length > slots:
        raise RuntimeError(
            f"exact attention over {length} keys, more than key_slots {slots} (the engine's "
            "max_model_len): the trainer and the engine must agree on it"
        )
    first = keep.any(dim=1).int().argmax(dim=-1)  # each sequence's first visible key
    where = first[:, None] + torch.arange(slots, device=key.device)  # [B, slots]
    inside = where < length
    where = where.clamp(max=length - 1)

    def shifted(t):  # [B, KV, T, D] -> [B, KV, slots, D], slot s = column first + s
        index = where[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
        return t.gather(2, index) * inside[:, None, :, None]

    keep_slots = keep.gather(2, where[:, None, :].expand(-1, keep.shape[1], -1)) & inside[:, None]
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        out = _ExactAttention.apply(query, key, value, keep, keep_slots, shifted, scaling)
    else:
        out = _attend(query, shifted(key), shifted(value), keep_slots, scaling)
    return out, None


def _attend(query, key, value, keep, scaling):
    """softmax(q k^T * scaling) v one row of G query heads at a time, ROWS rows per call.
    query [B, H, Tq, D]; key, value [B, KV, S, D] (S: key_slots); keep [B, Tq, S].
    Returns [B, Tq, H, D], as HF's attention functions do."""
    b, heads, tq, dim = query.shape
    kv, slots = key.shape[1], key.shape[2]
    group = heads // kv
    if scaling is None:
        scaling = dim**-0.5
    # one row per (b, kv, t): [N, G, D]; row r attends to the keys of sequence-head source[r]
    q = query.view(b, kv, group, tq, dim).permute(0, 1, 3, 2, 4).reshape(-1, group, dim)
    keys, values = key.reshape(b * kv, slots, dim), value.reshape(b * kv, slots, dim)
    seen = keep[:, None].expand(b, kv, tq, slots).reshape(-1, slots)
    seen = seen.clone()
    seen[:, 0] |= ~seen.any(dim=-1)  # a row that sees nothing (padding) sees slot 0: no NaN
    source = None if tq == 1 else torch.arange(b * kv, device=q.device).repeat_interleave(tq)
    out = q.new_empty(q.shape)
    for start in range(0, q.shape[0], ROWS):
        stop = min(start + ROWS, q.shape[0])
        if source is None:
            k, v = keys[start:stop], values[start:stop]
        else:
            k, v = keys[source[start:stop]], values[source[start:stop]]
        qc, sc = q[start:stop], seen[start:stop]
        short = ROWS - (stop - start)
        if short:
            qc, k, v = (torch.cat([t, t.new_zeros(short, *t.shape[1:])]) for t in (qc, k, v))
            sc = torch.cat([sc, sc.new_ones(short, slots)])
        scores = torch.bmm(qc, k.transpose(1, 2)).float() * scaling
        scores.masked_fill_(~sc[:, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(v.dtype)
        out[start:stop] = torch.bmm(weights, v)[: stop - start]
    return out.view(b, kv, tq, group, dim).permute(0, 2, 1, 3, 4).reshape(b, tq, heads, dim)


class _ExactAttention(torch.autograd.Function):
    """Exact forward; backward through sdpa on the same inputs (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, keep, keep_slots, shifted, scaling):
        ctx.save_for_backward(query, key, value, keep)
        ctx.scaling = scaling
        with torch.no_grad():
            return _attend(query, shifted(key), shifted(value), keep_slots, scaling)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, keep = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
            keep = keep.clone()
            keep[..., 0] |= ~keep.any(dim=-1)
            # Use sdpa's math kernel, whose matmuls add in a fixed order. cuDNN's and the memory-
            # efficient kernels accumulate dQ with atomics, so on an H200 the same step gave
            # different gradients run to run, and an exact run could not repeat itself.
            with sdpa_kernel(SDPBackend.MATH):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=keep[:, None], scale=ctx.scaling, enable_gqa=True
                )
            grads = torch.autograd.grad(out.transpose(1, 2), (q, k, v), grad)
        return (*grads, None, None, None, None)
