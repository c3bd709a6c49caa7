"""The transformers engine's decode loop: a paged KV cache, decode steps replayed as CUDA graphs,
sampling, logprobs and EOS / length stops on the device, and host reads every few steps.

    decoder = Decoder(model, float_mask=False)     # TransformersEngine makes one per weight layout
    results = decoder.generate(prompts, limits, pad=0, keys=keys, ..., max_rows=256)
    tokens, logprobs, length, finish = results[0]    # finish: "stop", "length" or "abort"

The model is a plain Hugging Face causal LM. Its forward runs with a 4D attention mask that we
build and with a cache object of ours (`SlabCache`), so any model whose attention layers call
`past_key_values.update(...)` works. On CUDA, each (rows bucket, slots) shape is captured once as
a graph. With compile_decode there is only one shape: the engine's most rows and longest
sequence. Decode attention (kernels.py) reads each row's slots only as far as the row has got,
through the row's page table. On CPU the same steps run eagerly, and attention runs through sdpa
over the rows' gathered pages.

Each row has its own next slot, so at the host's reads, finished rows leave and queued prompts
take their rows (continuous batching within a call). A row that holds nothing stays at slot 0.
A row takes pages of the cache as it grows and gives them back when it ends, so the short rows of
a long-tailed batch leave the pool to its long rows. With `kv_tokens` below rows x the longest
sequence, more rows run than a slab of max_model_len slots per row would hold. When the pool runs
out, the rows started last go back to the queue. Their draws are keyed, so they come out the
same when they run again.

Sampling (sampling.py) draws one uniform per row and step from a hash of (the row's key, the
step), so a seeded sample is the same whatever else is in the batch.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ferrule_rollout.exact import ExactNumerics
from ferrule_rollout.kernels import PAGE, decode_attention, supports, triton_available
from ferrule_rollout.regions import CompiledRegions
from ferrule_rollout.sampling import sample, sampling_logprobs, uniforms

READ_EVERY = 16  # decode steps between host reads (all rows done? stop strings?)
SLOT_ALIGN = PAGE  # a view's slots per row, rounded up to whole pages (few graph shapes)
KEPT_GRAPHS = 8  # captured (rows, slots) shapes kept; the oldest goes first
NARROWER = 16  # tail compaction moves the running rows into 1/16 of the rows (_Rows.compact)
FEWEST_ROWS = 8  # and never into fewer than this
PREFILL_TOKENS = 16384  # the most (padded) tokens in a prefill group: rows x the longest prompt
# Prefill's attention kernels, without cuDNN's. cuDNN is torch's first choice on Hopper, but it
# builds a plan for each new shape (76 ms each on an H200 against 2 ms for flash, and the same
# speed after that: benchmarks/RESULTS.md, 2026-11-30). Prefill groups change shape every call.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
PREFILL_SCORES = 1 << 24  # float masks: most scores per head per prefill forward, rows x new x seen


def slab_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """The engine's attention function, registered with transformers.

    Decode (one-token queries against the cache):
    - With `slab_table` (SlabCache.paged_reads, where `key` and `value` are the layer's pools),
      run kernels.decode_attention. It reads each row's pages only up to the row's own entry of
      `slab_slots`, which Decoder.forward passes down.
    - Otherwise run sdpa over the rows' gathered slots, with the query heads grouped under their
      KV head ([rows, kv, group, dim] against [rows, kv, slots, dim]). The cache is then read
      once, rather than first copied `group` times (HF's repeat_kv).
    Prefill:
    - With `causal_prefill` (Decoder.forward's `causal`: right-padded prompts that attend to
      their own columns only), run sdpa's causal kernels without a mask (flash on CUDA, see
      PREFILL_BACKENDS). A call's prefill at 1.5B took 2.2 s this way, where the mask took 3.8
      (benchmarks/RESULTS.md).
    - Otherwise run HF's sdpa with the mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, length, dim = query.shape
    slots, table = kw.pop("slab_slots", None), kw.pop("slab_table", None)
    if kw.pop("causal_prefill", False):  # right-padded prompts at slot 0 need only the causal mask
        group = heads // key.shape[1]
        key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
        with sdpa_kernel(PREFILL_BACKENDS):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2), None
    special = kw.get("sliding_window") or kw.get("softcap") or kw.get("s_aux") is not None
    if table is not None:
        if special or length != 1 or attention_mask.dtype != torch.bool:
            raise RuntimeError(  # plain_attention rules this out before the first step
                "paged decode attention got a query it does not cover (a sliding window, a "
                "softcap, attention sinks or a float mask)"
            )
        scale = dim**-0.5 if scaling is None else scaling
        out = decode_attention(query, key, value, attention_mask[:, 0, 0], slots, table, scale)
        return out, None
    if length != 1 or special:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
        )
    grouped = query.view(rows, key.shape[1], heads // key.shape[1], dim)
    out = F.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


def plain_attention(config) -> bool:
    """Whether every attention layer of the model is full causal attention (what
    decode_attention computes): no sliding window, no logit softcap."""
    kinds = getattr(config, "layer_types", None)
    if kinds is None:  # configs older than layer_types: a sliding_window, if set, applies
        windowed = bool(getattr(config, "sliding_window", None))
    else:
        windowed = any(kind != "full_attention" for kind in kinds)
    return not windowed and not getattr(config, "attn_logit_softcapping", None)


class SlabCache:
    """The KV cache as HF attention layers see it (through `update`).

    Each layer has a pool of pages for the keys and one for the values, each [pages, kv heads,
    PAGE, head dim]. A table [rows, pages per row] names the page that holds each row's slots
    PAGE * k to PAGE * (k + 1) - 1. A row takes pages as it grows (`cover`) and gives them back
    when it ends (`release`). Page 0 belongs to no row: a table entry without a page points at
    it, and nothing reads what an idle row or a captured graph writes there. Each row has its
    own next slot (in device tensors), so a captured graph writes wherever each row has got to
    when it replays. `pages` fixes the pool's size (the engine's kv_tokens). With None, the pool
    holds rows x the view's pages and grows with the view, so that no row waits for a page."""

    def __init__(self, config, dtype, device, pages: int | None = None):
        heads = config.num_attention_heads
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.dtype, self.device, self.fixed = dtype, device, pages
        self.keys, self.values = [], []  # per layer [pages, kv heads, PAGE, head dim]
        self.table = torch.zeros((0, 0), dtype=torch.long, device=device)  # [rows, pages per row]
        self.owned: list[list[int]] = []  # each row's pages, in slot order (host)
        self.free: list[int] = []  # pages no row holds
        self.rows = self.seen = self.pages = self.at = None  # set by `aim` before each forward
        self.paged_reads = False  # decode: `update` returns the whole pools (Decoder sets this)
        self.allocations = 0  # times the pool was (re)allocated, each time losing what it held

    def reserve(self, rows: int, length: int) -> bool:
        """Make room for `rows` rows of `length` slots (whole pages). Return True when the pool
        or the table had to be reallocated, which loses what the pages held."""
        width = length // PAGE
        pages = self.fixed or rows * width + 1  # unless fixed, all rows can reach the view's end
        if self.fixed is not None and self.fixed < width + 1:
            raise ValueError(
                f"a KV cache of {(self.fixed - 1) * PAGE} tokens cannot hold one sequence of "
                f"{length} slots"
            )
        have_rows, have_width = self.table.shape
        have = self.keys[0].shape[0] if self.keys else 0
        if rows <= have_rows and width <= have_width and pages <= have:
            return False
        rows, width, pages = max(rows, have_rows), max(width, have_width), max(pages, have)
        self.keys = self.values = []  # free the old ones first
        shape = (pages, self.kv_heads, PAGE, self.head_dim)
        # zeros, not empty: sdpa multiplies a masked-out slot by 0, and 0 * NaN is NaN
        self.keys, self.values = (
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
            for _ in "kv"
        )
        self.table = torch.zeros((rows, width), dtype=torch.long, device=self.device)
        self.owned = [[] for _ in range(rows)]
        self.free = list(range(pages - 1, 0, -1))  # pop() gives the lowest first
        self.allocations += 1
        return True

    def cover(self, wanted: dict[int, int], spare: int = 0) -> bool:
        """Give each row r of `wanted` pages up to slot wanted[r] (exclusive). Return False,
        giving no pages, when fewer pages are free than those plus `spare` more."""
        more = {r: -(-n // PAGE) - len(self.owned[r]) for r, n in wanted.items()}
        if sum(n for n in more.values() if n > 0) + spare > len(self.free):
            return False
        rows, at, pages = [], [], []
        for r, n in more.items():
            for _ in range(n):
                rows.append(r)
                at.append(len(self.owned[r]))
                pages.append(self.free.pop())
                self.owned[r].append(pages[-1])
        if pages:
            self.table[self._index(rows), self._index(at)] = self._index(pages)
        return True

    def release(self, rows) -> None:
        """Rows `rows` give their pages back; their table entries point at page 0 again."""
        rows = [r for r in rows if self.owned[r]]
        for r in rows:
            self.free.extend(reversed(self.owned[r]))
            self.owned[r] = []
        if rows:
            self.table[self._index(rows)] = 0

    def move(self, order: list[int]) -> None:
        """Row order[k] becomes row k (the tail's compaction), and its pages go with it. The
        rows after the moved ones hold no pages."""
        self.table[: len(order)] = self.table[self._index(order)]
        self.table[len(order) :] = 0
        moved = [self.owned[r] for r in order]
        self.owned = moved + [[] for _ in range(len(self.owned) - len(order))]

    def copy(self, rows, sources, slots: int) -> None:
        """Rows `rows` get the first `slots` slots of rows `sources` (device index tensors)."""
        width = -(-slots // PAGE)
        to, source = self.table[rows, :width].flatten(), self.table[sources, :width].flatten()
        for pool in (*self.keys, *self.values):
            pool[to] = pool[source]

    def gathered(self, pool, rows, slots: int):
        """Rows `rows`' first `slots` slots of `pool`, [rows, kv heads, slots, head dim]."""
        pages = pool[self.table[rows, : -(-slots // PAGE)]]  # [rows, pages, kv, PAGE, dim]
        count, width = pages.shape[:2]
        dense = pages.transpose(1, 2).reshape(count, self.kv_heads, width * PAGE, self.head_dim)
        return dense[:, :, :slots]

    def _index(self, values: list[int]):
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def aim(self, rows, slots, seen: int | None) -> None:
        """Set where the next forward writes. Decode (`rows` None): row r writes its one token
        at slots[r]. Prefill: rows `rows` write their tokens at the shared `slots`. The
        forward's attention reads each row's first `seen` slots (None: only prefill's own
        tokens). The pages and the offsets within them are looked up here once for every layer;
        otherwise a decode step would run three small kernels per layer."""
        self.rows, self.seen, self.at = rows, seen, slots % PAGE
        if rows is None:
            self.pages = self.table[torch.arange(len(slots), device=slots.device), slots // PAGE]
        else:
            self.pages = self.table[rows[:, None], slots[None, :] // PAGE]
            self.at = self.at[None, :]

    def update(self, key, value, layer_idx: int, *args, **kwargs):
        """Write the layer's new keys and values where `aim` said. Return what the layer's
        attention reads: the pools (decode with paged_reads), the new keys and values (causal
        prefill), or else the rows' first `seen` slots, gathered."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if key.shape[1] != self.kv_heads or key.shape[-1] != self.head_dim:
            raise RuntimeError(
                f"layer {layer_idx} gives keys of shape {tuple(key.shape)}; the cache expected "
                f"{self.kv_heads} heads of size {self.head_dim} (from the model's config)"
            )
        if self.rows is None:
            keys[self.pages, :, self.at] = key[:, :, 0]
            values[self.pages, :, self.at] = value[:, :, 0]
            if self.paged_reads:
                return keys, values
            rows = torch.arange(key.shape[0], device=key.device)
        else:
            keys[self.pages, :, self.at] = key.transpose(1, 2)
            values[self.pages, :, self.at] = value.transpose(1, 2)
            if self.seen is None:  # causal prefill from slot 0: the prompt sees only its own tokens
                return key, value
            rows = self.rows
        return self.gathered(keys, rows, self.seen), self.gathered(values, rows, self.seen)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never asked for positions: the caller passes position_ids


class Step:
    """One decode step at a fixed shape: static inputs, and its CUDA graph once captured."""

    def __init__(self, decoder: "Decoder", rows: int, length: int):
        device = decoder.device
        self.decoder = decoder
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.pad_ok = torch.zeros((rows, length), dtype=torch.bool, device=device)
        self.slot = torch.zeros(rows, dtype=torch.long, device=device)  # each row's next slot
        # 1 for a row that holds a prompt, 0 for an idle row. An idle row stays at slot 0, so
        # decode attention reads one slot of it, not the whole slab. (At 1.5B, with 256 rows and
        # 4160 slots, idle rows at the end read 30 GB a step: most of a long-tailed batch's time.)
        self.moving = torch.zeros(rows, dtype=torch.long, device=device)
        self.last = length - 1  # a row past its end stays at this slot until the host's next read
        self.last_position = min(length, decoder.max_positions or length) - 1
        self.graph = self.logits = None

    def _run(self):
        logits = self.decoder.step_forward(self.ids, self.positions, self.pad_ok, self.slot)
        self.positions.add_(self.moving[:, None]).clamp_(max=self.last_position)
        self.slot.add_(self.moving).clamp_(max=self.last)
        return logits

    def capture(self, pool) -> None:
        """Capture the step as a graph. The warm-up and capture runs write keys and values at
        the last slot of the step's rows. No sequence reaches that slot (the slab has room for
        the longest, and the token that a sequence ends on is never fed), so a capture in the
        middle of a call loses nothing."""
        self.slot.fill_(self.last)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisations, kernel selection
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self._run()
        self.slot.zero_()

    def run(self, ids):
        """Feed `ids` ([rows]) at each row's slot, advance each moving row, and return the
        logits."""
        self.ids.copy_(ids[:, None])
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits


def bucket(rows: int) -> int:
    """Rows padded up to a captured size: powers of two to 128, then multiples of 128."""
    return 1 << (rows - 1).bit_length() if rows <= 128 else -(-rows // 128) * 128


class Decoder:
    """Generates for a batch of prompts on one model (see the module docstring). Make a new
    Decoder whenever the parameters move to new storage (sleep / wake), because the graphs read
    the parameters in place. With `compile` on CUDA, decode steps go through torch.compile
    before they are captured."""

    def __init__(
        self,
        model,
        float_mask: bool,
        keep_last: bool = True,
        compile: bool = False,
        exact: ExactNumerics | None = None,
        most: tuple[int, int] | None = None,
        compact: int = NARROWER,
        reuse_cut: bool = False,
        kv_tokens: int | None = None,
    ):
        self.model = model
        self.exact = exact  # exact.py's mode: the slab is key_slots long, prompts right-padded
        first = next(model.parameters())
        self.device = first.device
        config = model.config.get_text_config()
        pages = None if kv_tokens is None else -(-kv_tokens // PAGE) + 1  # plus page 0
        self.cache = SlabCache(config, first.dtype, self.device, pages)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.float_mask, self.mask_dtype = float_mask, first.dtype
        self.extra = {"logits_to_keep": 1} if keep_last else {}
        self.use_graphs = self.device.type == "cuda"
        self.steps: dict[tuple[int, int], Step] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # compile (CUDA only): run decode steps through inductor, which fuses the norm, rotary
        # and activation kernels between the GEMMs. It compiles region by region (regions.py):
        # one compile serves every layer, and each new shape takes seconds.
        compiled = compile and self.use_graphs and exact is None  # inductor reorders math
        self.regions = CompiledRegions(model) if compiled else None
        if not compiled:
            self.step_forward = self.forward
        elif self.regions:
            self.step_forward = self._compiled_forward
        else:  # the model names no decoder layers: compile its whole forward, which is slow
            self.step_forward = torch.compile(self.forward, dynamic=False)
        # When compiled, every call decodes at one shape, `most` (the engine's most rows and its
        # longest sequence). That shape compiles once, in whichever call comes first, so the
        # held-out evaluation's few rows share the training steps' compile. Idle rows cost only
        # their weight reads.
        self.one_shape = None
        if compiled and most is not None:
            self.one_shape = (bucket(most[0]), -(-most[1] // SLOT_ALIGN) * SLOT_ALIGN)
        # When compiled, the decode loop's logprobs are compiled too (cast, temperature,
        # log_softmax: fused passes over [rows, vocabulary]). The inverse CDF's cumsum stays
        # eager, because inductor's split scan fails to generate code at 32 rows (torch 2.11).
        self.logprobs_of = torch.compile(sampling_logprobs, dynamic=False) if compiled else None
        # Draws without top-k / top-p go through kernels.draw, except in exact mode, whose
        # logprobs must be the trainer's to the bit.
        self.kernels = self.use_graphs and exact is None and triton_available()
        # Decode attention reads the pools through the table (kernels.decode_attention).
        # Otherwise (CPU, exact mode, a float mask, or attention that the kernel does not
        # cover), each layer gathers the rows' pages for sdpa.
        cache = self.cache
        cache.paged_reads = (
            self.use_graphs
            and exact is None
            and not float_mask
            and plain_attention(config)
            and supports(config.num_attention_heads, cache.kv_heads, cache.head_dim)
        )
        # Tail compaction moves the running rows into 1 / `compact` of the rows. 0 turns it off,
        # and exact mode never compacts.
        self.compacts = compact if compact > 1 and exact is None else 0
        # partial rollouts: a cut row's keys and values stay in the slab, and the next call
        # resumes the row there if it continues that sequence (see `_claim`; not in exact mode)
        self.reuse_cut = reuse_cut and exact is None
        self.parked: dict[tuple[int, ...], int] = {}  # a cut sequence -> the row that holds it
        self.parked_view = None  # (slots per row, cache.allocations) when the rows were parked
        self.requeued = 0  # rows sent back to the queue for want of pages (_Rows.ahead)

    def release(self) -> None:
        """Drop the graphs, their pool and the slab (the engine calls this before sleeping)."""
        self.steps.clear()
        self.cache.keys, self.cache.values, self.cache.owned, self.cache.free = [], [], [], []
        self.cache.table = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.parked = {}
        self.pool = self.step_forward = self.logprobs_of = self.regions = None

    def _compiled_forward(self, ids, positions, pad_ok, slots):
        """A decode step's forward through the compiled regions (then captured as a graph)."""
        with self.regions.active():
            return self.forward(ids, positions, pad_ok, slots)

    def forward(self, ids, positions, pad_ok, slots, rows=None, last=None, causal=False):
        """Return the logits of the last position.

        Decode (`rows` None): `slots` is [rows], each row's next slot.
        Prefill: `slots` is [tokens], shared by the slab rows `rows`, and `pad_ok` is theirs.
        With `last` (right-padded prompts), return each row's logits at its own last column
        instead. With `causal`, the tokens are the rows' first tokens (slots 0..), so attention
        needs no mask."""
        if causal:  # no [rows, tokens, slots] mask: HF passes a 4D mask through, unread
            mask = pad_ok[:, None, None, :]
        else:
            where = torch.arange(pad_ok.shape[1], device=self.device)
            query = slots[:, None] if rows is None else slots[None, :]  # [rows or 1, tokens]
            keep = (pad_ok[:, None, :] & (where <= query[..., None])) | (where == query[..., None])
            mask = keep[:, None]  # [rows, 1, tokens, slots]; a pad token sees itself (no NaN rows)
            if self.float_mask:
                low = torch.finfo(self.mask_dtype).min
                mask = torch.zeros(mask.shape, dtype=self.mask_dtype, device=self.device)
                mask.masked_fill_(~keep[:, None], low)
        # Attention reads the first pad_ok.shape[1] slots of each row (the view's width, or exact
        # mode's key slots). Causal prefill reads only its own tokens.
        self.cache.aim(rows, slots, None if causal else pad_ok.shape[1])
        extra, pick = self.extra, None
        if rows is None and self.cache.paged_reads:  # each row's pages up to its slot
            extra = dict(extra, slab_slots=slots, slab_table=self.cache.table[: len(slots)])
        if causal:
            extra = dict(extra, causal_prefill=True)
        if last is not None:  # only distinct last columns go through the LM head
            columns, pick = torch.unique(last, return_inverse=True)
            extra = dict(extra, logits_to_keep=columns) if self.extra else extra
            pick = pick if self.extra else last
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            **extra,
        )
        if pick is None:
            return out.logits[:, -1]
        return out.logits[torch.arange(len(pick), device=self.device), pick]

    def _step(self, rows: int, length: int) -> Step:
        if self.cache.reserve(rows, length):
            self.steps.clear()  # the graphs captured the old buffers; the old pool goes with them
            self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        step = self.steps.pop((rows, length), None)
        if step is None:
            if len(self.steps) >= KEPT_GRAPHS:
                self.steps.pop(next(iter(self.steps)))
            step = Step(self, rows, length)
            if self.use_graphs:
                step.capture(self.pool)
        self.steps[(rows, length)] = step  # the most recently used goes last
        return step

    def generate(
        self,
        prompts: list[list[int]],
        limits: list[int],
        *,
        pad: int,
        keys: list[int],
        temperature: float,
        top_k: int,
        top_p: float,
        eos: list[int] | None,
        stop_hit=None,
        read_every: int = READ_EVERY,
        max_rows: int | None = None,
        carried: list[int] | None = None,
        cut_below: int = 0,
        final: list[bool] | None = None,
    ):
        """Sample up to limits[r] tokens after prompts[r]. Return, per prompt, (tokens,
        logprobs, length, finish), where finish is "stop" (EOS or a stop string), "length" (the
        limit) or "abort" (cut, see below).

        At most `max_rows` rows run at once. At each host read (every `read_every` steps),
        finished rows leave and queued prompts take their rows. `eos` lists the tokens that end
        a row (None: ignore EOS). `stop_hit(tokens)` is checked on the host for each new token,
        at those reads.

        Partial rollouts: `carried[r]` is the number of last tokens of prompts[r] that an
        earlier call generated (a cut sample, continued). The sample's draws go on from there,
        and its stop strings see those tokens. With `cut_below` > 0, the call ends at a read
        where no prompt waits, fewer than `cut_below` rows run, and none of them is `final`.
        Those rows then return what they have, as "abort". Otherwise a long-tailed batch's last
        rows would decode almost alone."""
        # The slots that the longest sequence needs, taking each sequence's prompt plus its own
        # limit: a continued sample's long prompt has a short limit. (The widest prompt plus the
        # largest limit asked for 6.5k slots of a 4160-slot engine at 1.5B, and ran out of
        # memory growing the slab.)
        count = len(prompts)
        longest = max(len(p) + limit for p, limit in zip(prompts, limits, strict=True))
        running = min(count, max_rows or count)
        batch = bucket(running) if self.use_graphs else running
        length = -(-(longest - 1) // SLOT_ALIGN) * SLOT_ALIGN
        if self.one_shape is not None:
            batch, length = max(batch, self.one_shape[0]), max(length, self.one_shape[1])
        if self.exact is not None:  # every attention sums over the same slots
            if length > self.exact.key_slots:
                raise ValueError(
                    f"{longest - 1} prompt and new tokens do not fit the exact mode's "
                    f"{self.exact.key_slots} key slots"
                )
            length = self.exact.key_slots
        wanted = self._parked_rows(prompts)
        if wanted:  # the parked rows' view: their slots per row, and enough rows to hold them
            length, widest = max(length, self.parked_view[0]), max(wanted.values()) + 1
            batch = max(batch, bucket(widest) if self.use_graphs else widest)
        state = _Rows(self, prompts, limits, keys, pad, batch, running, length, eos, stop_hit)
        state.partial(carried, cut_below, final)
        state.read_every = read_every
        with torch.inference_mode():
            state.step = self._step(batch, length)
            state.step.pad_ok.zero_()  # rows not taken see only themselves
            state.step.positions.zero_()
            state.step.slot.zero_()
            state.step.moving.zero_()
            sampling = (temperature, top_k, top_p)
            claims = self._claim(wanted, length)
            self.cache.release(set(range(len(self.cache.owned))) - set(claims.values()))
            state.resume(0, claims)
            state.fill(0, sampling)
            state.ahead(0)
            t = 0
            while True:
                due = (t + 1) % read_every == 0 or t + 1 >= state.horizon
                if due and not state.read(t, sampling):
                    break
                t += 1
                state.grow(t + 1)
                logits = state.step.run(state.chosen)
                chosen, logprob = sample(
                    logits, *sampling, state.u[:, t], self.logprobs_of, self.kernels
                )
                state.record(t, chosen, logprob)
        return state.results

    def _parked_rows(self, prompts: list[list[int]]) -> dict[int, int]:
        """Find the prompts that continue a sequence that the last call cut. Return {prompt
        index: row}, where the row holds that sequence's keys and values. A sequence asked for
        twice maps only its first prompt."""
        if not self.parked:
            return {}
        parked, wanted = dict(self.parked), {}
        for i, prompt in enumerate(prompts):
            row = parked.pop(tuple(prompt), None)
            if row is not None:
                wanted[i] = row
        return wanted

    def _claim(self, wanted: dict[int, int], length: int) -> dict[int, int]:
        """Return the rows of `wanted` (from _parked_rows) that this call resumes. That is all
        of them while the slab is the one they were written to, viewed at the same slots per row
        (generate widens its view to their rows), and none otherwise. Whatever this call does
        not continue is forgotten, and its rows are free to be overwritten. The keys and values
        were computed under the weights of the call that cut them, and a weight update in
        between does not recompute them. PipelineRL's in-flight updates do the same, and
        [rollout] reuse_cut_kv documents it."""
        self.parked = {}
        if (length, self.cache.allocations) != self.parked_view:
            return {}
        return wanted


class _Rows:
    """The bookkeeping of one `Decoder.generate` call: the prompt that each slab row holds and
    the step where it started, every row's tokens by step, and the prompts waiting for a row."""

    def __init__(self, decoder, prompts, limits, keys, pad, batch, running, length, eos, stop_hit):
        dev = self.device = decoder.device
        self.decoder, self.prompts, self.limits, self.keys = decoder, prompts, limits, keys
        self.pad, self.running, self.length, self.stop_hit = pad, running, length, stop_hit
        self.step, self.read_every = None, READ_EVERY
        self.partial()
        self.queue = list(range(len(prompts)))[::-1]  # pop() takes them in order
        self.holder = [-1] * batch  # the prompt each row holds (-1: none)
        self.start = [0] * batch  # the step of the row's first token
        self.base = [0] * batch  # step t writes at slot base + t
        self.walked = [0] * batch  # stop strings: the row's next step to walk on the host
        self.seen: list[list[int]] = [[] for _ in range(batch)]  # row's tokens so far, for stop_hit
        self.stops: dict[int, int] = {}  # row -> the sample's length at its stop string
        self.horizon = 0  # no row runs past this step
        self.results: list = [None] * len(prompts)
        self.ends = torch.zeros(batch, dtype=torch.long, device=dev)  # the step a row ends at
        self.chosen = torch.zeros(batch, dtype=torch.long, device=dev)
        self.eos = None if eos is None else torch.tensor(eos, dtype=torch.long, device=dev)
        self.eos_set = set(eos or ())
        self.tokens = torch.zeros((batch, 0), dtype=torch.long, device=dev)
        self.logprobs = torch.zeros((batch, 0), dtype=torch.float32, device=dev)
        self.u = torch.zeros((batch, 0), dtype=torch.float64, device=dev)

    def partial(self, carried=None, cut_below: int = 0, final=None) -> None:
        """Set up partial rollouts (Decoder.generate's `carried`, `cut_below`, `final`); off by
        default."""
        self.carried = carried or [0] * len(self.prompts)
        self.cut_below, self.final = cut_below, final or [False] * len(self.prompts)

    def grow(self, steps: int) -> None:
        """Make room for `steps` steps in the by-step tables (at least doubling them)."""
        have = self.tokens.shape[1]
        if have < steps:
            more = max(steps, 2 * have) - have
            self.tokens, self.logprobs, self.u = (
                torch.cat([t, t.new_zeros(t.shape[0], more)], dim=1)
                for t in (self.tokens, self.logprobs, self.u)
            )

    def record(self, t: int, chosen, logprob) -> None:
        self.tokens[:, t], self.logprobs[:, t], self.chosen = chosen, logprob, chosen
        if self.eos is not None:
            self.ends = torch.where(
                torch.isin(chosen, self.eos), self.ends.clamp(max=t + 1), self.ends
            )

    def resume(self, t: int, claims: dict[int, int]) -> None:
        """Rows that hold the keys and values of a sequence that the last call cut take the
        prompts that continue it (`claims`, from Decoder._claim), with no prefill. The
        sequence's last token, drawn but not yet fed, goes in at step t + 1, which draws the
        row's first new token."""
        if not claims:
            return
        taken, rows, dev = list(claims), list(claims.values()), self.device
        self.queue = [i for i in self.queue if i not in claims]
        limits = [self.limits[i] for i in taken]
        self.grow(t + 1 + max(limits))
        draws = uniforms(
            [self.keys[i] for i in taken], max(limits), [self.carried[i] for i in taken], dev
        )
        at, fed = torch.tensor(rows, device=dev), [len(self.prompts[i]) - 1 for i in taken]
        self.u[at, t + 1 : t + 1 + max(limits)] = draws
        self.chosen[at] = torch.tensor([self.prompts[i][-1] for i in taken], device=dev)
        self.ends[at] = torch.tensor([t + 1 + n for n in limits], device=dev)
        step, fed = self.step, torch.tensor(fed, device=dev)
        step.pad_ok[at] = True  # up to each row's slot, as for a prefilled row
        step.positions[at], step.slot[at], step.moving[at] = fed[:, None], fed, 1
        for r, i in zip(rows, taken, strict=True):
            before = self.prompts[i][len(self.prompts[i]) - self.carried[i] :]
            self.holder[r], self.start[r], self.walked[r], self.seen[r] = i, t + 1, t + 1, before
            self.base[r] = len(self.prompts[i]) - 1 - (t + 1)
            self.stops.pop(r, None)
        self.horizon = max(self.horizon, t + 1 + max(limits))

    def fill(self, t: int, sampling) -> None:
        """Free rows take queued prompts: prefill them, and draw their first token as step t.
        A group prefilled together is right-padded to its longest prompt, so the prompts go in
        groups of similar length, of at most PREFILL_TOKENS padded tokens. (A continued sample's
        prompt can be thousands of tokens long; padding 512 short prompts to its length ran out
        of memory at 1.5B.)"""
        free = [r for r, held in enumerate(self.holder) if held < 0]
        taking = min(len(free), len(self.queue), self.running - len(self.holder) + len(free))
        if taking <= 0:
            return
        taken = [self.queue.pop() for _ in range(taking)]
        if not self.fits(taken):
            taken.sort(key=lambda i: len(self.prompts[i]))  # by length; one group keeps queue order
        first = 0
        while first < taking:
            last = first + 1
            while last < taking and self.fits(taken[first : last + 1]):
                last += 1
            if not self.admit(free[first:last], taken[first:last]):
                last = first + 1  # retry alone: padding to a long prompt's width takes more pages
                if not self.admit(free[first:last], taken[first:last]):
                    self.queue.extend(reversed(taken[first:]))  # they wait for pages
                    return
            self.take(t, free[first:last], taken[first:last], sampling)
            first = last

    def admit(self, rows: list[int], taken: list[int]) -> bool:
        """Give rows `rows` the pages to prefill prompts `taken` (right-padded to the longest)
        and to decode until the next read. A fixed pool must also keep one spare page for each
        row already running. Return False, giving no pages, when the pool lacks them."""
        width = max(len(self.prompts[i]) for i in taken)
        wanted = {
            r: self.reach(width, len(self.prompts[i])) for r, i in zip(rows, taken, strict=True)
        }
        cache = self.decoder.cache
        spare = sum(1 for i in self.holder if i >= 0) if cache.fixed else 0
        return cache.cover(wanted, spare)

    def reach(self, width: int, slot: int) -> int:
        """Return the slots that a row needs until the next host read: those before `width`,
        and `slot` (where the row writes next) with the read_every slots after it, within the
        view."""
        return min(self.length, max(width, slot + self.read_every + 1))

    def ahead(self, t: int) -> None:
        """After step t, give every running row pages until the next read. When the pool has
        too few, the rows started last go back to the queue, with their pages freed and their
        tokens dropped. Their draws are keyed, so they come out the same when they run again."""
        cache = self.decoder.cache
        while True:
            held = [r for r, i in enumerate(self.holder) if i >= 0]
            wanted = {r: self.reach(0, self.base[r] + t + 1) for r in held}
            if cache.cover(wanted):
                return
            last = max(held, key=lambda r: (self.start[r], r))
            self.queue.append(self.holder[last])
            self.holder[last] = -1
            self.idle(torch.tensor([last], device=self.device))
            cache.release([last])
            self.decoder.requeued += 1

    def fits(self, group: list[int]) -> bool:
        """Whether prompts `group` can be prefilled together (a single one always can)."""
        return len(group) * max(len(self.prompts[i]) for i in group) <= PREFILL_TOKENS

    def take(self, t: int, rows: list[int], taken: list[int], sampling) -> None:
        """Rows `rows` take prompts `taken`: prefill them together, and draw their first token
        as step t."""
        taking, group = len(rows), [self.prompts[i] for i in taken]
        width, dev = max(map(len, group)), self.device
        ids = torch.full((taking, width), self.pad, dtype=torch.long)
        positions = torch.zeros((taking, width), dtype=torch.long)
        for k, prompt in enumerate(group):
            # Right padding: a sequence's tokens sit at slots 0.. (as in the trainer's view, and
            # attention within the prompt is plain causal). The row's own next tokens overwrite
            # its pad columns before anything attends to them.
            ids[k, : len(prompt)] = torch.tensor(prompt)
            positions[k, : len(prompt)] = torch.arange(len(prompt))
        at = torch.tensor(rows, device=dev)
        self.step.pad_ok[at] = True
        pad_ok = self.step.pad_ok[at]
        lengths = torch.tensor([len(p) for p in group])
        logits = self.prefill(group, ids, positions, pad_ok, at, lengths)
        limits = [self.limits[i] for i in taken]
        self.grow(t + max(limits) + 1)
        draws = uniforms(
            [self.keys[i] for i in taken], max(limits), [self.carried[i] for i in taken], dev
        )
        self.u[at, t : t + max(limits)] = draws
        first, logprob = sample(logits, *sampling, draws[:, 0], kernel=self.decoder.kernels)
        self.tokens[at, t], self.logprobs[at, t], self.chosen[at] = first, logprob, first
        ends = torch.tensor([t + n for n in limits], device=dev)
        if self.eos is not None:
            ends = torch.where(torch.isin(first, self.eos), ends.clamp(max=t + 1), ends)
        self.ends[at] = ends
        self.step.positions[at] = lengths[:, None].to(dev)
        self.step.slot[at] = lengths.to(dev)
        self.step.moving[at] = 1
        for r, i in zip(rows, taken, strict=True):
            before = self.prompts[i][len(self.prompts[i]) - self.carried[i] :]
            self.holder[r], self.start[r], self.walked[r], self.seen[r] = i, t, t, before
            self.base[r] = len(self.prompts[i]) - t - 1
            self.stops.pop(r, None)
        self.horizon = max(self.horizon, t + max(limits))

    def prefill(self, group, ids, positions, pad_ok, at, lengths):
        """Run the group's forward into slots [0, width) of rows `at`, once for each distinct
        prompt. The n samples of a prompt share its prefill: the prompt's other rows get copies
        of its keys and values. Return the logits of each row's last prompt token (column
        lengths - 1, since the prompts are right-padded)."""
        index: dict[tuple, int] = {}  # a distinct prompt -> its index in `firsts`
        firsts, where = [], []
        for k, prompt in enumerate(group):
            if tuple(prompt) not in index:
                index[tuple(prompt)] = len(firsts)
                firsts.append(k)
            where.append(index[tuple(prompt)])
        dev, width = self.device, ids.shape[1]
        once = torch.tensor(firsts, device=dev)
        ids, positions, pad_ok = ids.to(dev)[once], positions.to(dev)[once], pad_ok[once]
        last, decoder = (lengths[firsts] - 1).to(dev), self.decoder
        if decoder.exact is not None or not decoder.float_mask:  # one forward over the columns
            slots = torch.arange(width, device=dev)
            causal = decoder.exact is None  # exact mode: the trainer's masked sum over the slab
            seen = pad_ok[:, :width] if causal else pad_ok  # the keys that the prefill attends to
            logits = decoder.forward(
                ids, positions, seen, slots, rows=at[once], last=last, causal=causal
            )
        else:  # a float mask: run windows of columns, each attending to the slots before its end
            step = max(1, min(width, PREFILL_SCORES // (len(firsts) * width)))
            for begin in range(0, width, step):
                end = min(width, begin + step)
                got = decoder.forward(
                    ids[:, begin:end],
                    positions[:, begin:end],
                    pad_ok[:, :end],
                    torch.arange(begin, end, device=dev),
                    rows=at[once],
                    last=(last - begin).clamp(0, end - begin - 1),
                )
                inside = ((last >= begin) & (last < end))[:, None]  # rows whose last is in here
                logits = got if begin == 0 else torch.where(inside, got, logits)
        if len(firsts) == len(group):
            return logits
        where = torch.tensor(where, device=dev)
        self.decoder.cache.copy(at, at[once][where], width)  # from the row that ran the prefill
        return logits[where]

    def read(self, t: int, sampling) -> bool:
        """After step t, check stop strings, let finished rows leave and queued prompts enter.
        Return False once all prompts are done (or the call is cut)."""
        ends = self.ends.tolist()
        held = [r for r, i in enumerate(self.holder) if i >= 0]
        if self.stop_hit is not None and held:
            self.walk(t, held, ends)
        done = [r for r in held if ends[r] <= t + 1]
        if self.cut_below and not self.queue:
            running = [r for r in held if ends[r] > t + 1]
            if 0 < len(running) < self.cut_below and not any(
                self.final[self.holder[r]] for r in running
            ):
                for r in running:
                    ends[r] = t + 1
                cut = {r: self.holder[r] for r in running}
                self.leave(t, done, ends, cut=running)
                self.park(cut)
                return False
        self.leave(t, done, ends)
        if self.queue:
            self.fill(t, sampling)
        elif self.decoder.compacts:
            self.compact()
        self.ahead(t)
        return any(i >= 0 for i in self.holder) or bool(self.queue)

    def leave(self, t: int, done: list[int], ends: list[int], cut: list[int] = ()) -> None:
        """Rows `done` (ended by step t) and `cut` record their prompts' results, and hold
        nothing from now on."""
        rows = [*done, *cut]
        if not rows:
            return
        at = torch.tensor(rows, device=self.device)
        tokens, logprobs = self.tokens[at, : t + 1].tolist(), self.logprobs[at, : t + 1].tolist()
        for r, row, values in zip(rows, tokens, logprobs, strict=True):
            i, start, n = self.holder[r], self.start[r], ends[r] - self.start[r]
            row, values = row[start : ends[r]], values[start : ends[r]]
            if r in cut:
                finish = "abort"
            elif n < self.limits[i] or self.stops.get(r) == n or row[-1] in self.eos_set:
                finish = "stop"
            else:
                finish = "length"
            self.results[i] = (row, values, n, finish)
            self.holder[r] = -1
        self.idle(at)
        kept = cut if self.decoder.reuse_cut else ()  # cut rows keep their pages for `park`
        self.decoder.cache.release([r for r in rows if r not in kept])

    def park(self, cut: dict[int, int]) -> None:
        """With the decoder's reuse_cut, the rows of `cut` ({row: prompt index}) keep the keys
        and values of their sequences for the next call. These cover the prompt and the tokens
        so far, all of which have been fed except the last token."""
        decoder = self.decoder
        if not decoder.reuse_cut:
            return
        for r, i in cut.items():
            decoder.parked[tuple(self.prompts[i] + self.results[i][0])] = r
        decoder.parked_view = (self.length, decoder.cache.allocations)

    def compact(self) -> None:
        """Once no prompt waits and the rows still running fit in 1 / `compacts` of the rows,
        move them to the first rows and decode at that narrower shape from then on. A
        long-tailed batch spends most of its steps on a few long responses, and a step costs its
        rows' weight reads and sampling whether the rows run or idle. Each narrower width is a
        shape that is compiled once (compile_decode) and captured, and the tails of later calls
        reuse it. The rows move again whenever 1 / `compacts` of them suffice, down to
        FEWEST_ROWS. (With the engine's NARROWER = 16, that happens once: 512 rows into 32.)"""
        rows, held = len(self.holder), [r for r, i in enumerate(self.holder) if i >= 0]
        fewer = rows // self.decoder.compacts
        if fewer < FEWEST_ROWS or not held or len(held) > fewer:
            return
        order = held + [r for r, i in enumerate(self.holder) if i < 0][: fewer - len(held)]
        at, decoder, old = torch.tensor(order, device=self.device), self.decoder, self.step
        decoder.cache.move(order)  # their pages go with them: nothing copied
        self.step = decoder._step(fewer, self.length)  # a narrower view of the same first rows
        for name in ("positions", "pad_ok", "slot", "moving"):
            getattr(self.step, name).copy_(getattr(old, name)[at])
        self.ends, self.chosen, self.tokens, self.logprobs, self.u = (
            t[at] for t in (self.ends, self.chosen, self.tokens, self.logprobs, self.u)
        )
        self.holder, self.start, self.base, self.walked, self.seen = (
            [values[r] for r in order]
            for values in (self.holder, self.start, self.base, self.walked, self.seen)
        )
        moved = {r: k for k, r in enumerate(order)}
        self.stops = {moved[r]: n for r, n in self.stops.items() if r in moved}

    def idle(self, rows) -> None:
        """Rows `rows` hold nothing from now on: they stay at slot 0, seeing only it."""
        step = self.step
        step.moving[rows] = step.slot[rows] = step.positions[rows] = 0
        step.pad_ok[rows] = False

    def walk(self, t: int, held: list[int], ends: list[int]) -> None:
        """Pass each running row's new tokens through stop_hit. A stop string ends the row at
        that token."""
        first = min(self.walked[r] for r in held)
        new, found = self.tokens[:, first : t + 1].tolist(), {}
        for r in held:
            for step in range(self.walked[r], t + 1):
                if r in self.stops or step >= ends[r]:
                    break
                self.seen[r].append(new[r][step - first])
                if self.stop_hit(self.seen[r]):
                    self.stops[r], found[r] = step + 1 - self.start[r], step + 1
            self.walked[r] = t + 1
        if found:
            for r, end in found.items():
                ends[r] = min(ends[r], end)
            at = torch.tensor(list(found), device=self.device)
            self.ends[at] = torch.tensor([ends[r] for r in found], device=self.device)
