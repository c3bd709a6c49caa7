"""The transformers engine's decode loop: a preallocated KV slab, decode steps replayed as CUDA
graphs, sampling, logprobs and EOS / length stops on the device, the host reading every few steps.

    decoder = Decoder(model, float_mask=False)     # TransformersEngine makes one per weight layout
    tokens, logprobs, lengths, stopped = decoder.generate(prompts, limits, pad=0, keys=keys, ...)

The model is a plain Hugging Face causal LM: its forward runs with a 4D attention mask we build and
a cache object of ours (`SlabCache`), so any model whose attention layers call
`past_key_values.update(...)` works. On CUDA each (rows bucket, slots) shape is captured once as a
graph; on CPU the same steps run eagerly. Sampling draws one uniform per row and step from a hash of
(the row's key, the step), so a seeded sample is the same whatever else is in the batch.
"""

import torch
import torch.nn.functional as F

READ_EVERY = 16  # decode steps between host reads (all rows done? stop strings?)
SLOT_ALIGN = 64  # the slab's slots per row, rounded up to this (few distinct graph shapes)
KEPT_GRAPHS = 8  # captured (rows, slots) shapes kept; the oldest goes first
MASK32 = 0xFFFFFFFF


def sampling_logprobs(logits, temperature: float, top_k: int, top_p: float):
    """Log-probabilities of the distribution a token is drawn from (vLLM's processed logprobs):
    log_softmax(logits / temperature) over the top-k, then top-p, tokens; greedy (temperature
    0): log_softmax(logits). Float32 whatever the model's dtype."""
    logits = logits.float()
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:  # as vLLM: drop the least likely tokens whose total mass is <= 1 - top_p
        ascending, order = scaled.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        scaled = scaled.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scaled, dim=-1)


def _mix(x):
    """A 32-bit integer hash of int64 values in [0, 2**32) (constants < 2**31: no overflow)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def uniforms(keys, steps: int):
    """[rows, steps] float64 uniforms in [0, 1): row r's draw at step t depends on keys[r] and t
    only (a counter-based generator: no state to carry, the same in any batch and any chunk)."""
    keys = torch.as_tensor(keys, dtype=torch.long)
    row = _mix(_mix((keys & MASK32) ^ 0x6A09E667) ^ ((keys >> 32) & MASK32))
    step = _mix(torch.arange(steps, dtype=torch.long) + 0x3C6EF372)
    high = _mix(row[:, None] ^ step[None, :])
    low = _mix(high ^ 0x5BD1E995)
    return ((high << 21) + (low >> 11)).double() / 2.0**53


def sample(logits, temperature: float, top_k: int, top_p: float, u):
    """One token per row and its logprob under `sampling_logprobs`, on the logits' device:
    greedy at temperature 0, else by inverse CDF at the row's uniform `u` (float64 [rows])."""
    logprobs = sampling_logprobs(logits, temperature, top_k, top_p)
    if temperature == 0:
        chosen = logits.argmax(dim=-1)
    else:
        cdf = logprobs.exp().cumsum(dim=-1)
        # u < 1 - 2**-20: never the total itself, so never a token of probability 0 after it
        point = (u * (1 - 2.0**-20)).float()[:, None] * cdf[:, -1:]
        chosen = torch.searchsorted(cdf, point, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    return chosen, logprobs.gather(1, chosen[:, None])[:, 0]


def slab_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """sdpa for one-token queries against the slab: the query heads are grouped under their KV
    head ([rows, kv, group, dim] against [rows, kv, slots, dim]), so the cache is read once
    rather than copied `group` times first (HF's repeat_kv). Prefill goes to HF's sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, length, dim = query.shape
    if length != 1 or kw.get("sliding_window") or kw.get("softcap") or kw.get("s_aux") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
        )
    grouped = query.view(rows, key.shape[1], heads // key.shape[1], dim)
    out = F.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


class SlabCache:
    """The KV cache as HF attention layers see it (`update`): per layer one flat buffer, viewed
    as [rows, kv heads, slots, head dim] for each call, allocated once and grown when a call
    needs more. `update` writes at `slots` (a device tensor), so a captured graph writes wherever
    the decode has got to when it replays."""

    def __init__(self, config, dtype, device):
        heads = config.num_attention_heads
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.dtype, self.device = dtype, device
        self.buffers, self.keys, self.values, self.slots = [], [], [], None

    def reserve(self, rows: int, length: int) -> bool:
        """View the buffers as `rows` x `length` slots; True when they had to be reallocated."""
        half = rows * self.kv_heads * length * self.head_dim
        grew = not self.buffers or self.buffers[0].numel() < 2 * half
        if grew:
            self.buffers = self.keys = self.values = []  # free the old ones first
            self.buffers = [  # zeros: a masked slot is multiplied by 0, and 0 * NaN is NaN
                torch.zeros(2 * half, dtype=self.dtype, device=self.device)
                for _ in range(self.layers)
            ]
        shape = (rows, self.kv_heads, length, self.head_dim)
        self.keys = [b[:half].view(shape) for b in self.buffers]
        self.values = [b[half : 2 * half].view(shape) for b in self.buffers]
        return grew

    def update(self, key, value, layer_idx: int, *args, **kwargs):
        keys, values = (t[layer_idx][: key.shape[0]] for t in (self.keys, self.values))
        if key.shape[1] != self.kv_heads or key.shape[-1] != self.head_dim:
            raise RuntimeError(
                f"layer {layer_idx} gives keys of shape {tuple(key.shape)}; the slab expected "
                f"{self.kv_heads} heads of size {self.head_dim} (from the model's config)"
            )
        keys.index_copy_(2, self.slots, key)
        values.index_copy_(2, self.slots, value)
        return keys, values

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
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.graph = self.logits = None

    def _run(self):
        logits = self.decoder.step_forward(self.ids, self.positions, self.pad_ok, self.slot)
        self.positions += 1
        self.slot += 1
        return logits

    def capture(self, pool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisations, kernel selection
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self._run()

    def run(self, ids):
        """The logits after feeding `ids` ([rows]) at the current slot; advances one slot."""
        self.ids.copy_(ids[:, None])
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits


def bucket(rows: int) -> int:
    """Rows padded up to a captured size: powers of two to 128, then multiples of 128."""
    return 1 << (rows - 1).bit_length() if rows <= 128 else -(-rows // 128) * 128


class Decoder:
    """Generates for a batch of prompts on one model (see the module docstring). Make a new one
    whenever the parameters move to new storage (sleep / wake): graphs read them in place.
    `compile`: on CUDA, decode steps go through torch.compile before they are captured."""

    def __init__(self, model, float_mask: bool, keep_last: bool = True, compile: bool = False):
        self.model = model
        first = next(model.parameters())
        self.device = first.device
        self.cache = SlabCache(model.config.get_text_config(), first.dtype, self.device)
        self.float_mask, self.mask_dtype = float_mask, first.dtype
        self.extra = {"logits_to_keep": 1} if keep_last else {}
        self.use_graphs = self.device.type == "cuda"
        self.steps: dict[tuple[int, int], Step] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # compile (CUDA only): decode steps through inductor, which fuses the norms, rotary and
        # residual kernels between the GEMMs; each new shape compiles first (tens of seconds).
        compiled = compile and self.use_graphs
        self.step_forward = torch.compile(self.forward, dynamic=False) if compiled else self.forward

    def release(self) -> None:
        """Drop the graphs, their pool and the slab (the engine calls this before sleeping)."""
        self.steps.clear()
        self.cache.buffers, self.cache.keys, self.cache.values = [], [], []
        self.pool = self.step_forward = None

    def forward(self, ids, positions, pad_ok, slots):
        """Logits of the last position; `slots` (device) are where these tokens' keys go."""
        where = torch.arange(pad_ok.shape[1], device=self.device)
        keep = (pad_ok[:, None, :] & (where <= slots[:, None])) | (where == slots[:, None])
        mask = keep[:, None]  # [rows, 1, tokens, slots]; a pad token sees itself (no NaN rows)
        if self.float_mask:
            low = torch.finfo(self.mask_dtype).min
            mask = torch.zeros(mask.shape, dtype=self.mask_dtype, device=self.device)
            mask.masked_fill_(~keep[:, None], low)
        self.cache.slots = slots
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            **self.extra,
        )
        return out.logits[:, -1]

    def _step(self, rows: int, length: int) -> Step:
        if self.cache.reserve(rows, length):
            self.steps.clear()  # they captured the old buffers; a pool no graph holds is gone
            self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        step = self.steps.pop((rows, length), None)
        if step is None:
            if len(self.steps) >= KEPT_GRAPHS:
                self.steps.pop(next(iter(self.steps)))
            step = Step(self, rows, length)
            if self.use_graphs:
                step.capture(self.pool)
        self.steps[(rows, length)] = step  # the most recent last
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
    ):
        """Sample up to limits[r] tokens after prompts[r]; returns per row (tokens, logprobs,
        length, stopped). `eos`: tokens that end a row (None: ignore EOS). `stop_hit(tokens)`:
        checked on the host after each new token, at reads every `read_every` steps."""
        rows, width, steps = len(prompts), max(map(len, prompts)), max(limits)
        batch = bucket(rows) if self.use_graphs else rows
        length = -(-(width + steps - 1) // SLOT_ALIGN) * SLOT_ALIGN
        with torch.inference_mode():
            step = self._step(batch, length)
            ids = torch.full((rows, width), pad, dtype=torch.long)
            positions = torch.zeros((rows, width), dtype=torch.long)
            pad_ok = torch.zeros((batch, length), dtype=torch.bool)  # extra rows see themselves
            for r, prompt in enumerate(prompts):  # left padding: every row's next token is last
                ids[r, width - len(prompt) :] = torch.tensor(prompt)
                positions[r, width - len(prompt) :] = torch.arange(len(prompt))
                pad_ok[r, width - len(prompt) :] = True
            dev = self.device
            step.pad_ok.copy_(pad_ok)
            logits = self._prefill(prompts, ids, positions, step.pad_ok[:rows])
            lengths = torch.tensor([len(p) for p in prompts] + [0] * (batch - rows))
            step.positions.copy_(lengths[:, None])
            step.slot.fill_(width)
            u = uniforms(list(keys) + [0] * (batch - rows), steps).to(dev)
            ends = torch.tensor(limits + [0] * (batch - rows), device=dev)  # length of each row
            eos_ids = None if eos is None else torch.tensor(eos, dtype=torch.long, device=dev)
            tokens = torch.zeros((batch, steps), dtype=torch.long, device=dev)
            logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=dev)
            host = [[] for _ in range(rows)]  # tokens seen by stop_hit
            stops: dict[int, int] = {}  # row -> length at its stop string
            read, chosen = 0, None
            for t in range(steps):
                if t:
                    logits = step.run(chosen)
                elif batch > rows:
                    logits = torch.cat([logits, logits.new_zeros(batch - rows, logits.shape[1])])
                chosen, logprob = sample(logits, temperature, top_k, top_p, u[:, t])
                tokens[:, t], logprobs[:, t] = chosen, logprob
                if eos_ids is not None:
                    ends = torch.where(torch.isin(chosen, eos_ids), ends.clamp(max=t + 1), ends)
                if (t + 1) % read_every and t + 1 < steps:
                    continue
                if stop_hit is not None:
                    self._check_stops(tokens[:rows, read : t + 1], ends, host, stops, stop_hit)
                read = t + 1
                if bool((ends <= t + 1).all()):
                    break
            ends, tokens, logprobs = ends[:rows].tolist(), tokens[:rows], logprobs[:rows]
            tokens, logprobs = tokens[:, : max(ends)].tolist(), logprobs[:, : max(ends)].tolist()
        eos_set = set(eos or ())
        out = []
        for r in range(rows):
            n = ends[r]
            stopped = n < limits[r] or stops.get(r) == n or (n > 0 and tokens[r][n - 1] in eos_set)
            out.append((tokens[r][:n], logprobs[r][:n], n, stopped))
        return out

    def _prefill(self, prompts, ids, positions, pad_ok):
        """The prompts' forward into slots [0, width) of the slab, each distinct prompt once
        (the n samples of a prompt share it: its rows of the slab are copies); last logits."""
        index: dict[tuple, int] = {}  # a distinct prompt -> its row among the prefilled
        firsts, where = [], []
        for r, prompt in enumerate(prompts):
            if tuple(prompt) not in index:
                index[tuple(prompt)] = len(firsts)
                firsts.append(r)
            where.append(index[tuple(prompt)])
        once, width, dev = torch.tensor(firsts), ids.shape[1], self.device
        slots = torch.arange(width, device=dev)
        logits = self.forward(
            ids[once].to(dev), positions[once].to(dev), pad_ok[once.to(dev)], slots
        )
        if len(firsts) == len(prompts):
            return logits
        # each row of the slab takes the keys and values of its prompt's prefilled row
        where = torch.tensor(where, device=dev)
        for layer in (*self.cache.keys, *self.cache.values):
            layer[: len(prompts), :, :width] = layer[: len(firsts), :, :width][where]
        return logits[where]

    @staticmethod
    def _check_stops(new, ends, host, stops, stop_hit) -> None:
        """Walk each running row's new tokens on the host; a stop string ends the row there."""
        limits, found = ends[: len(host)].tolist(), {}
        for r, row in enumerate(new.tolist()):
            for token in row:
                if r in stops or len(host[r]) >= limits[r]:
                    break
                host[r].append(token)
                if stop_hit(host[r]):
                    stops[r] = found[r] = len(host[r])
        if found:
            index = torch.tensor(list(found), device=ends.device)
            ends[index] = torch.minimum(ends[index], torch.tensor(list(found.values())).to(ends))
