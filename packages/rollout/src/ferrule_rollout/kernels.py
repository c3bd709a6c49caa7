"""The transformers engine's Triton kernels (CUDA): decode attention that reads, through a row's
page table, only the slots that the row has used; and the decode loop's draw.

    out = decode_attention(query, keys, values, visible, slots, table, scale)  # [rows,1,heads,dim]
    chosen, logprob = draw(logits, temperature, u)                             # [rows] each

decode_attention: SDPA against a dense slab reads every slot of every row at each step, empty
slots included. At 1.5B, with 512 rows and 576 slots, that took 3.6 ms of a 10.2 ms step
(benchmarks/RESULTS.md, issue 42). Here one program per (row, KV head) walks the row's slots in
blocks of PAGE, up to the row's own next slot (`slots[r]`, where it just wrote). Each block is
read from the page that the row's table names. (decode.py's SlabCache stores pages of PAGE slots,
so a short sequence holds few of them.) A row 100 tokens in thus reads 100 slots, whatever the
view's length. The query heads of a KV head are the rows of that head's program, which gives
grouped-query attention without copying the cache. Softmax runs online in float32.

When the view has few rows (the tail's narrower rows, or an evaluation's rows), each row's slots
are split over programs of SPLIT slots, and a second kernel combines their partial sums
(flash-decoding). Without the split, one program walking a 16k-token row alone took most of a
step. The op is registered with torch.library, so torch.compile (the engine's compile_decode)
treats it as one opaque call. A CUDA graph captures it with the slots and the table as device
tensors, so a replay reads as far as each row has got, from wherever its pages are.

draw: sampling.sample's inverse-CDF draw at temperature T without top-k / top-p, with one program
per row. The program makes one pass for the row's log-sum-exp, then keeps a running sum up to the
row's point. It reads the logits twice, where the eager draw makes five float32 passes over
[rows, vocabulary] (1.6 ms at 512 rows x 151,936). Its sums run in a different order than
torch's cumsum, so a draw at a CDF boundary may pick the neighbouring token. Either token is a
correct draw; exact mode keeps the eager draw.

Triton is imported on first use, so CPU-only installs never need it.
"""

import functools

import torch

PAGE = 64  # slots in a page of the KV cache; a kernel block reads one page
SPLIT = 256  # slots per program when decode_attention splits rows (a whole number of pages)
MIN_PROGRAMS_PER_SM = 2  # split rows below this many (row, KV head) programs per SM
VOCAB_BLOCK = 2048  # vocabulary entries per iteration of the draw
_kernel = _draw_kernel = None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decode_attention covers a model's attention. It needs at most 16 query heads per
    KV head (one tl.dot tile), a power-of-two head size of 16 or more, and an importable Triton."""
    if heads % kv_heads or heads // kv_heads > 16 or head_dim & (head_dim - 1) or head_dim < 16:
        return False
    return triton_available()


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        Q, K, V, VISIBLE, SLOTS, TABLE, ACC, BEST, TOTAL, OUT, scale, span,
        q_row, q_head, k_page, k_head, k_slot, v_page, v_head, v_slot, vis_row, t_row, o_row,
        o_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
        PAGE: tl.constexpr,
        SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM)
        heads = h * GROUP + g
        last = tl.load(SLOTS + r)  # the row's own slot: nothing after it is visible
        begin = split * span
        q = tl.load(
            Q + r * q_row + heads[:, None] * q_head + d[None, :],
            mask=(g < GROUP)[:, None],
            other=0.0,
        )
        best = tl.full([GROUP_PAD], -1.0e30, tl.float32)  # finite, so a masked block gives no NaN
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        for start in range(begin, tl.minimum(begin + span, last + 1), PAGE):
            within = tl.arange(0, PAGE)
            j = start + within
            page = tl.load(TABLE + r * t_row + start // PAGE).to(tl.int64)
            seen = tl.load(VISIBLE + r * vis_row + j, mask=j <= last, other=0) != 0
            k = tl.load(
                K + page * k_page + h * k_head + within[:, None] * k_slot + d[None, :],
                mask=seen[:, None],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where(seen[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            p = tl.exp(s - new_best[:, None])
            shrink = tl.exp(best - new_best)
            total = total * shrink + tl.sum(p, axis=1)
            v = tl.load(
                V + page * v_page + h * v_head + within[:, None] * v_slot + d[None, :],
                mask=seen[:, None],
                other=0.0,
            )
            acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        if SPLITS == 1:  # one split covers the row: store the output (0 if the row sees no slot)
            tl.store(
                OUT + r * o_row + heads[:, None] * o_head + d[None, :],
                (acc / tl.where(total > 0, total, 1.0)[:, None]).to(OUT.dtype.element_ty),
                mask=(g < GROUP)[:, None],
            )
        else:  # store this split's unnormalised partial sums for `combine`. A split that
            # begins past the row's slot stores nothing, and `combine` does not read it.
            live = (g < GROUP) & (begin <= last)
            at = (r * GROUP * tl.num_programs(1) + heads) * SPLITS + split
            tl.store(BEST + at, best, mask=live)
            tl.store(TOTAL + at, total, mask=live)
            tl.store(ACC + at[:, None] * DIM + d[None, :], acc, mask=live[:, None])

    @triton.jit
    def combine(
        ACC, BEST, TOTAL, SLOTS, OUT, span, o_row, o_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM)
        heads = h * GROUP + g
        used = g < GROUP
        base = (r * GROUP * tl.num_programs(1) + heads) * SPLITS
        best = tl.full([GROUP_PAD], -1.0e30, tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        for split in range(0, tl.load(SLOTS + r) // span + 1):  # the row's splits only
            b = tl.load(BEST + base + split, mask=used, other=-1.0e30)
            t = tl.load(TOTAL + base + split, mask=used, other=0.0)
            a = tl.load(
                ACC + (base + split)[:, None] * DIM + d[None, :], mask=used[:, None], other=0.0
            )
            new_best = tl.maximum(best, b)
            old, this = tl.exp(best - new_best), tl.exp(b - new_best)
            total = total * old + t * this
            acc = acc * old[:, None] + a * this[:, None]
            best = new_best
        out = acc / tl.where(used & (total > 0), total, 1.0)[:, None]
        tl.store(
            OUT + r * o_row + heads[:, None] * o_head + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=used[:, None],
        )

    return kernel, combine


@torch.library.custom_op("ferrule::slab_decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each row's one new query token over the row's cached slots.

    query: [rows, heads, 1, dim].
    keys, values: [pages, kv heads, PAGE, dim], last dim contiguous.
    visible: [rows, view slots] bool, the slots each row may attend to (its prompt and its
        tokens up to its slot).
    slots: [rows] int64, each row's last written slot.
    table: [rows, pages per row] int64; table[r, k] is the page that holds row r's slots
        PAGE * k to PAGE * (k + 1) - 1.
    Returns [rows, 1, heads, dim], as Hugging Face attention functions do."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    attend, combine = _kernel
    rows, heads, _, dim = query.shape
    kv, length = keys.shape[1], visible.shape[1]
    group = heads // kv
    out = torch.empty((rows, 1, heads, dim), dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    visible = visible.view(torch.uint8) if visible.dtype == torch.bool else visible  # no copy
    # Decide from the shapes alone, so that a captured graph keeps its grid. A few (row, KV
    # head) programs leave most of the GPU idle while each walks its row, so each long row is
    # split over several programs. Many programs fill the GPU already, and splitting them costs
    # the partial sums' writes and dead programs. At 1.5B, splitting made 512 rows 1.5x slower
    # and 16 rows at 16k slots 2.3x faster (benchmarks/RESULTS.md, 2026-12-01).
    few = rows * kv < MIN_PROGRAMS_PER_SM * _multiprocessors(query.device)
    splits = -(-length // SPLIT) if few else 1
    split, span = splits > 1, SPLIT if splits > 1 else length
    if split:  # each split's partial sums
        best, total = (query.new_empty((rows, heads, splits), dtype=torch.float32) for _ in "bt")
        acc = query.new_empty((rows, heads, splits, dim), dtype=torch.float32)
    else:  # the kernel writes `out` itself
        best = total = acc = out
    shapes = dict(GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), DIM=dim)
    attend[(rows, kv, splits)](
        query, keys, values, visible, slots, table, acc, best, total, out, scale, span,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), visible.stride(0),
        table.stride(0), out.stride(0), out.stride(2), PAGE=PAGE, SPLITS=splits,
        PRECISION="ieee" if query.dtype == torch.float32 else None,  # float32 stays float32
        **shapes,
    )  # fmt: skip
    if split:
        combine[(rows, kv)](
            acc, best, total, slots, out, span, out.stride(0), out.stride(2), SPLITS=splits,
            **shapes,
        )  # fmt: skip
    return out


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The number of the GPU's streaming multiprocessors (4 under Triton's CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@decode_attention.register_fake
def _(query, keys, values, visible, slots, table, scale):
    rows, heads, _, dim = query.shape
    return query.new_empty((rows, 1, heads, dim))


def _build_draw():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(LOGITS, U, CHOSEN, LOGPROB, temperature, vocab, row, u_row, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        base = LOGITS + r * row
        j = tl.arange(0, BLOCK)
        # the log-sum-exp of logits / T, per lane, then across lanes (with a finite start,
        # -inf logits add 0)
        best = tl.full([BLOCK], -1.0e30, tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + j, mask=start + j < vocab, other=float("-inf"))
            x = x.to(tl.float32) / temperature
            new_best = tl.maximum(best, x)
            total = total * tl.exp(best - new_best) + tl.exp(x - new_best)
            best = new_best
        top = tl.max(best, axis=0)
        mass = tl.sum(total * tl.exp(best - top), axis=0)  # the sum of exp(x / T - top)
        # sampling.sample's point: u * (1 - 2**-20) of the total mass, never the total itself
        point = (tl.load(U + r * u_row) * (1 - 2.0**-20)).to(tl.float32) * mass
        chosen = vocab - 1  # like sample's clamp, in case rounding leaves the point past the end
        start = 0
        below = 0.0
        while start < vocab:
            x = tl.load(base + start + j, mask=start + j < vocab, other=float("-inf"))
            p = tl.exp(x.to(tl.float32) / temperature - top)
            above = (below + tl.cumsum(p, axis=0) > point) & (start + j < vocab)
            first = tl.min(tl.where(above, start + j, vocab), axis=0)
            if first < vocab:
                chosen = first
                start = vocab  # found: leave the loop
            else:
                below += tl.sum(p, axis=0)
                start += BLOCK
        logit = tl.load(base + chosen).to(tl.float32) / temperature
        tl.store(CHOSEN + r, chosen.to(tl.int64))
        tl.store(LOGPROB + r, logit - top - tl.log(mass))

    return kernel


def draw(logits: torch.Tensor, temperature: float, u: torch.Tensor):
    """Draw one token per row of `logits` ([rows, vocabulary], last dim contiguous) from
    softmax(logits / temperature), by inverse CDF at the row's uniform `u` (float64 [rows], any
    stride). Return the tokens and their log-probabilities (float32). This is sampling.sample's
    draw without top-k / top-p."""
    global _draw_kernel
    if _draw_kernel is None:
        _draw_kernel = _build_draw()
    rows, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    chosen = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _draw_kernel[(rows,)](
            logits, u, chosen, logprob, float(temperature), vocab, logits.stride(0), u.stride(0),
            BLOCK=VOCAB_BLOCK, num_warps=8,
        )  # fmt: skip
    return chosen, logprob
