"""The transformers rollout engine: `VLLMEngine`'s interface on a plain Hugging Face model.

    engine = TransformersEngine(tiny_model("qwen2"), dtype="float32", max_model_len=256)
    samples = engine.generate(["2 + 2 ="], SamplingSettings(n=4, max_tokens=32))
    engine.init_weight_sync("broadcast", "10.0.0.1", 29600, rank=1, num_receivers=1)
    engine.update_weights()         # waits for running calls, receives, loads; returns version

This engine is the fallback for machines without vLLM (torch and transformers only). Each call
runs through decode.py's loop, with at most `max_batch_size` sequences at once; queued sequences
take the rows of finished ones. The loop runs the model's forward pass on a preallocated KV slab,
with CUDA graphs on GPUs, and samples and stops on the device. Sampling, logprobs and stopping
are done there rather than by `model.generate`, so that they mean what vLLM's mean (processed
logprobs, per-sample seeds, EOS kept in the tokens), whatever defaults `generate` would merge in
from the checkpoint and its version. No steps x batch x vocabulary scores are kept either. Calls
run one at a time, and a weight update waits for the running call, so every sample comes from
one policy version.
"""

import inspect
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ferrule_rollout.decode import NARROWER, Decoder, slab_attention
from ferrule_rollout.engine_base import EngineBase
from ferrule_rollout.exact import ExactNumerics
from ferrule_rollout.interface import WeightSyncGroup
from ferrule_rollout.joining import JoinAbandoned, Joining
from ferrule_rollout.samples import (
    BadRequestError,
    Continuation,
    Prompt,
    RolloutError,
    Sample,
    SamplingSettings,
    VersionSpan,
    prompt_token_ids,
)
from ferrule_rollout.sampling import sampling_logprobs

logger = logging.getLogger(__name__)
DTYPES = ("auto", "float32", "bfloat16", "float16")
PARAMETER_ALIGNMENT = 16  # bytes: the alignment of each parameter in the engine's allocation
ATTENTION = "ferrule_slab"  # slab_attention, registered with transformers under this name
__all__ = ["TransformersEngine", "lay_out", "sampling_logprobs"]
KEEP_REFUSED = (
    'the transformers engine only supports pause mode "wait" (it runs whole calls, so there is '
    'nothing to freeze mid-sample); use backend "vllm" for "keep"'
)


def lay_out(entries: list, device) -> list:
    """Return uninitialised tensors for the (shape, dtype) `entries`. They lie in order, one
    after another, in one allocation per dtype, and each starts aligned to PARAMETER_ALIGNMENT
    bytes, as kernels expect. A model's tensors mostly fill whole multiples of the alignment, so
    they lie end to end."""
    import torch

    starts, ends = [], {}  # each entry's start (elements); each dtype's end so far
    for shape, dtype in entries:
        align = max(PARAMETER_ALIGNMENT // dtype.itemsize, 1)
        starts.append(ends.get(dtype, 0))
        ends[dtype] = starts[-1] + -(-torch.Size(shape).numel() // align) * align
    flat = {dtype: torch.empty(end, dtype=dtype, device=device) for dtype, end in ends.items()}
    return [
        flat[dtype][start : start + torch.Size(shape).numel()].view(shape)
        for (shape, dtype), start in zip(entries, starts, strict=True)
    ]


class ComputedStream:
    """The result of `generate_stream`: the samples, already computed, behind the stream's
    methods."""

    def __init__(self, samples: list[Sample]):
        self._samples = iter(samples)

    def __iter__(self):
        return self

    def __next__(self) -> Sample:
        return next(self._samples)

    def cancel(self) -> None:
        self._samples = iter(())

    close = cancel


def extended(spans: list, version: int, start: int, count: int) -> list[VersionSpan]:
    """Return `spans` extended with tokens [start, start + count) sampled by `version`. A run of
    one version stays one span."""
    if spans and spans[-1].version == version:
        return [*spans[:-1], VersionSpan(version, spans[-1].start, start + count)]
    return [*spans, VersionSpan(version, start, start + count)]


def _continued(prompts: Sequence, max_tokens: int) -> list[Continuation | None]:
    """Return each prompt's `Continuation`, or None for a plain prompt. Raise BadRequestError
    for a Continuation that cannot continue."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        return []  # prompt_token_ids names what is wrong
    continued = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, Continuation):
            continued.append(None)
            continue
        sample = prompt.sample
        if not isinstance(sample, Sample) or sample.finish_reason != "abort":
            raise BadRequestError(f"prompt {index} continues a sample that was not cut")
        if len(sample.token_ids) >= max_tokens:
            raise BadRequestError(
                f"prompt {index} continues a sample of {len(sample.token_ids)} tokens; "
                f"max_tokens is {max_tokens}"
            )
        continued.append(prompt)
    return continued


def _checked_arguments(model, dtype, max_batch_size, exact: bool, compile_decode: bool) -> Path:
    """Check that the engine takes every argument, and return the model's folder."""
    path = Path(model).expanduser()
    if not path.is_dir():
        raise RolloutError(f"model path {str(model)!r} does not exist (or is not a folder)")
    if dtype not in DTYPES:
        raise RolloutError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise RolloutError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
    if exact and compile_decode:
        raise RolloutError("exact and compile_decode exclude each other: inductor reorders math")
    return path


class TransformersEngine(EngineBase):
    """A transformers model with policy versions, pause / resume and weightsync weight updates."""

    continuous_batching = False
    """Calls run one at a time (episodes.py batches waiting turns into the next call). Within a
    call, finished rows leave and queued prompts take their rows."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "auto",
        max_batch_size: int = 256,
        kv_cache_tokens: int | None = None,
        attn_implementation: str | None = None,
        compile_decode: bool = False,
        exact: bool = False,
        compact_rows: bool = True,
        reuse_cut_kv: bool = False,
    ):
        """Load `model` (a local Hugging Face model folder) on `device`. "auto" means the current
        CUDA device if there is one, else the CPU. dtype "auto" is bfloat16 on CUDA and float32
        on CPU.

        `compile_decode` (CUDA only): run decode steps through torch.compile, then capture them
        as graphs as without it. This is faster once the first call has compiled its step's
        regions, which takes seconds (decode.py, regions.py). Every call then decodes at one
        shape, max_batch_size rows x max_model_len slots.
        `kv_cache_tokens`: the KV cache's size, in pages of 64 slots that rows take as they
        grow. None means max_batch_size x max_model_len, which no call outgrows. The cache is
        allocated at the first call, as vLLM's is, and must hold at least max_model_len.
        `exact`: exact.py's batch-invariant numerics. A trainer that applies the same
        `exact_numerics` then computes the very same logprobs from the same weights (slower;
        no torch.compile).
        `compact_rows`: a call's last running rows move into fewer rows once they fit in 1/16
        of them (decode.py's _Rows.compact).
        `reuse_cut_kv`: a call cut with `cut_below` leaves its cut samples' keys and values in
        their rows. The next call that continues those samples resumes them there without a
        prefill, even after a weight update (decode.py's Decoder._claim). Not with `exact`."""
        path = _checked_arguments(model, dtype, max_batch_size, exact, compile_decode)
        super().__init__(str(path))
        self._decoder = None  # made on first use, dropped whenever the parameters move
        self._load_model(path, dtype, device, attn_implementation)
        config = self._model.config.get_text_config()
        self.max_model_len = self._fitting_length(config, max_model_len)
        self.exact_numerics = None
        if exact:  # after max_model_len, because the slab's slots follow from it
            self.exact_numerics = ExactNumerics(self.max_model_len)
            self.exact_numerics.apply(self._model, slab=True)
            self._float_mask = False
        self.vocab_size = config.vocab_size
        self.max_batch_size = max_batch_size
        if kv_cache_tokens is not None and kv_cache_tokens < self.max_model_len:
            raise RolloutError(
                f"kv_cache_tokens {kv_cache_tokens} cannot hold one sequence of max_model_len "
                f"{self.max_model_len}"
            )
        self._kv_tokens = kv_cache_tokens
        self._eos, self._pad = self._stop_and_pad_ids()
        self._keep_last = "logits_to_keep" in inspect.signature(self._model.forward).parameters
        import torch  # loaded by _load_model

        self._rng = torch.Generator().manual_seed(seed)  # the keys of unseeded samples
        self._compile, self._compact = compile_decode, compact_rows
        self._reuse_cut = reuse_cut_kv  # the decoder ignores it in exact mode
        self._sent: list[str] = []  # names of the last update (what weights_digest covers)
        self._model_lock = threading.Lock()  # one generate call or weight change at a time
        self._update_lock = threading.Lock()  # one weight update at a time
        self._join_lock = threading.Lock()  # one weight-sync join at a time
        self._running = self._queued = 0  # samples of calls admitted / waiting out a pause
        self._dropped: dict[int, str] = {}  # parameters sleep(level=2) dropped, not yet reloaded
        self._asleep = 0  # the sleep level, 0 when awake
        self._shapes: dict = {}  # shapes of the parameters that sleep(level=2) dropped
        self._can_sleep = self.device.type == "cuda"
        self._receiver = None

    def _load_model(
        self, path: Path, dtype: str, device: str, attn_implementation: str | None
    ) -> None:
        """Set up the device, the tokenizer and the model on the device; time the start-up."""
        began = time.perf_counter()
        import torch
        from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

        imported = time.perf_counter()
        try:
            auto = "cuda" if torch.cuda.is_available() else "cpu"
            self.device = torch.device(auto if device == "auto" else device)
            if self.device.type == "cuda" and self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        except (RuntimeError, ValueError) as err:
            raise RolloutError(f"device {device!r} is not usable: {err}") from err
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            # Our masks are 4D: additive floats for "eager", and booleans for sdpa. Every other
            # choice runs as sdpa, because flash attention takes no such mask.
            self._float_mask = attn_implementation == "eager"
            if attn_implementation not in (None, "eager", "sdpa"):
                logger.info("attention %r: the engine runs sdpa instead", attn_implementation)
            AttentionInterface.register(ATTENTION, slab_attention)
            loaded = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=getattr(torch, dtype),
                attn_implementation="eager" if self._float_mask else ATTENTION,
            )
            self._model = loaded.eval().requires_grad_(False)
            self._lay_out_parameters()
            self._model.to(self.device)  # moves the buffers; the parameters are there already
        except Exception as err:
            raise RolloutError(
                f"could not load a transformers model from {self.model!r}: {err}"
            ) from err
        self._startup = {"imports": imported - began, "weights": time.perf_counter() - imported}

    def _fitting_length(self, config, max_model_len: int | None) -> int:
        """Return max_model_len, checked against what the model's positions and attention
        allow."""
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            raise RolloutError(
                f"{self.model} has sliding-window attention layers, which the transformers "
                'engine\'s decode masks do not model; use backend "vllm"'
            )
        longest = getattr(config, "max_position_embeddings", None)
        length = max_model_len or longest
        if not length or (longest and length > longest):
            raise RolloutError(
                f"max_model_len {max_model_len} does not fit the model's length {longest} "
                f"(max_position_embeddings in {self.model}/config.json)"
            )
        return length

    def _stop_and_pad_ids(self) -> tuple[set[int], int]:
        """Return the tokens that end a sample and the token that pads. The stop tokens are the
        tokenizer's EOS and the generation config's (which may be a list)."""
        generation = getattr(self._model, "generation_config", None)
        eos = [self.tokenizer.eos_token_id, getattr(generation, "eos_token_id", None)]
        stops = {i for e in eos if e is not None for i in ([e] if isinstance(e, int) else e)}
        pad = self.tokenizer.pad_token_id
        return stops, pad if pad is not None else min(stops, default=0)

    # -- generation ------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> list[Sample]:
        """Generate `settings.n` samples per prompt, and one per `Continuation` (which continues
        a cut sample). Return them in prompt, then sample order. While the engine is paused, the
        call waits, and nothing is lost. With `settings.cut_below`, the call may end before its
        longest samples do, and those return unfinished (finish_reason "abort")."""
        settings = settings or SamplingSettings()
        continued = _continued(prompts, settings.max_tokens)
        if any(continued):
            prompts = [
                p if c is None else c.sample.prompt_token_ids + c.sample.token_ids
                for p, c in zip(prompts, continued, strict=True)
            ]
        checked = prompt_token_ids(prompts, self.tokenizer, self.vocab_size, self.max_model_len)
        continued = continued or [None] * len(checked)
        rows = [
            (p, i) if c is None else (p, c.sample.sample_index)
            for p, c in enumerate(continued)
            for i in range(settings.n if c is None else 1)
        ]
        with self._cv:
            self._queued += len(rows)
            self._cv.wait_for(lambda: not self._paused or self._closed)
            self._queued -= len(rows)
            why = "closed" if self._closed else self._broken or ("asleep" if self._asleep else "")
            if why:
                raise RolloutError(f"the engine cannot generate: {why}")
            self._running += len(rows)
        try:
            with self._model_lock:
                return self._generate(checked, rows, settings, continued)
        finally:
            with self._cv:
                self._running -= len(rows)
                self._cv.notify_all()

    def reseed(self, seed: int) -> None:
        """Draw the keys of unseeded samples afresh from `seed`. The launcher does so before each
        step's generation with [rollout] exact, so that a step's samples depend on the step and
        the weights alone, not on what the engine generated before. A run resumed from a
        checkpoint then samples what the uninterrupted run did."""
        with self._model_lock:
            self._rng.manual_seed(seed)

    def generate_stream(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> ComputedStream:
        """`generate` for callers written for VLLMEngine's stream. It computes every sample
        first, then yields them (a call does not join a running one). `cancel()` drops the
        rest."""
        return ComputedStream(self.generate(prompts, settings))

    def _generate(self, checked, rows, settings: SamplingSettings, continued) -> list[Sample]:
        import torch

        prompts = [checked[p] for p, _ in rows]
        if not prompts:
            return []
        if settings.seed is not None:  # sample i of a prompt uses seed + i, as in vLLM
            keys = [settings.seed + i for _, i in rows]
        else:
            keys = torch.randint(2**62, (len(rows),), generator=self._rng).tolist()
        earlier = [continued[p] for p, _ in rows]  # each row's Continuation, else None
        carried = [0 if c is None else len(c.sample.token_ids) for c in earlier]
        keys = [
            key if c is None or c.sample.draw_key is None else c.sample.draw_key
            for key, c in zip(keys, earlier, strict=True)
        ]
        stops, window = settings.stop, 4 * max(map(len, settings.stop), default=0) + 8

        def stop_hit(tokens: list[int]) -> bool:  # decode only the tail: a new stop ends there
            tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
            return any(s in tail for s in stops)

        if self._decoder is None:
            self._decoder = Decoder(
                self._model,
                self._float_mask,
                self._keep_last,
                compile=self._compile,
                exact=self.exact_numerics,
                most=(self.max_batch_size, self.max_model_len),
                compact=NARROWER if self._compact else 0,
                reuse_cut=self._reuse_cut,
                kv_tokens=self._kv_tokens,
            )
        results = self._decoder.generate(
            prompts,
            [
                min(settings.max_tokens - done, self.max_model_len - len(p))
                for p, done in zip(prompts, carried, strict=True)
            ],
            pad=self._pad,
            keys=keys,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            eos=None if settings.ignore_eos else sorted(self._eos),
            stop_hit=stop_hit if stops else None,
            max_rows=self.max_batch_size,
            carried=carried,
            cut_below=settings.cut_below,
            final=[c is not None and c.final for c in earlier],
        )
        samples = []
        for (p, i), prompt, key, c, (token_ids, logprobs, _, finish) in zip(
            rows, prompts, keys, earlier, results, strict=True
        ):
            before = Sample(p, i, prompt, [], [], "", self._version) if c is None else c.sample
            spans = extended(before.versions, self._version, len(before.token_ids), len(token_ids))
            token_ids = before.token_ids + token_ids
            samples.append(
                Sample(
                    prompt_index=p,
                    sample_index=i,
                    prompt_token_ids=before.prompt_token_ids,
                    token_ids=token_ids,
                    logprobs=before.logprobs + logprobs,
                    finish_reason=finish,
                    version=min(before.version, self._version),
                    text=self._text(token_ids, finish == "stop", settings),
                    versions=spans,
                    draw_key=key if finish == "abort" else None,
                )
            )
        return samples

    def _text(self, token_ids: list[int], stopped: bool, settings: SamplingSettings) -> str:
        """Return the response text as vLLM writes it: without the EOS token's text, and cut
        before the stop string that completes first."""
        on_eos = stopped and not settings.ignore_eos and token_ids[-1] in self._eos
        text = self.tokenizer.decode(
            token_ids[:-1] if on_eos else token_ids, skip_special_tokens=True
        )
        found = [(text.find(s) + len(s), text.find(s)) for s in settings.stop if s in text]
        return text[: min(found)[1]] if stopped and not on_eos and found else text

    # -- pause, resume, weight updates -----------------------------------------------------

    def pause(self, mode: str = "wait", timeout: float | None = None) -> None:
        """Stop starting new calls (they wait, and nothing is lost), and return once the running
        call has finished on the current weights. Only "wait" mode exists: see KEEP_REFUSED."""
        if mode != "wait":
            raise BadRequestError(KEEP_REFUSED if mode == "keep" else f"unknown mode {mode!r}")
        with self._cv:
            self._paused = True
            if not self._cv.wait_for(lambda: not self._running, timeout):
                raise RolloutError(
                    f"pause: {self._running} samples still running after {timeout:g}s "
                    "(the engine stays paused; resume() or wait longer)"
                )

    def _join(self, group: WeightSyncGroup, given_up) -> None:
        from ferrule_weightsync import create_receiver

        # `timeout` bounds the wait for the sender to appear too (weightsync's own default for
        # that is 900 s, which kept a join with no sender going for 15 minutes).
        options = {**group.options(), "connect_timeout": group.timeout}
        if group.transport == "broadcast":
            options["device"] = self.device
        with self._join_lock:  # one join at a time: each replaces the group
            with self._update_lock:
                if self._receiver is not None:
                    self._receiver.close()
                    self._receiver = None
            # Join without the update lock, so that close() need not wait for the sender either.
            receiver = Joining(lambda: create_receiver(**options)).wait(given_up)
            with self._update_lock:
                if self._closed:  # closed as the join completed: nothing will receive
                    receiver.close()
                    raise JoinAbandoned("the engine was closed while it joined")
                self._receiver = receiver

    def update_weights(self, mode: str = "wait", timeout: float | None = None) -> int:
        """Receive one update and copy it into the model; return its version.

        Wait for the running call to finish (new calls wait meanwhile), then up to `timeout`
        seconds for the sender to start. Names and shapes are checked against the model before
        any data moves, so a wrong name or shape leaves the weights unchanged. A failure once
        data flows leaves the weights partly replaced, and the engine refuses to generate until
        an update loads.
        """
        if mode != "wait":
            raise BadRequestError(KEEP_REFUSED if mode == "keep" else f"unknown mode {mode!r}")
        if self._receiver is None:
            raise RolloutError("no weight-sync group to receive from: call init_weight_sync first")
        with self._update_lock:
            if self._closed or self._asleep:
                raise RolloutError(
                    "weight update: the engine is "
                    + ("closed" if self._closed else "asleep: call wake_up() first")
                )
            was_paused = self._paused
            if not was_paused:
                self.pause("wait")
            try:
                with self._model_lock:
                    version = self._load(timeout)
            finally:
                if not was_paused:
                    self.resume()
        logger.info("loaded weights of policy version %d", version)
        return version

    def _load(self, timeout: float | None) -> int:
        import torch

        targets = self._tensors()
        loaded = []
        try:
            # Names and shapes are checked before any data moves. The update is copied in place,
            # a few copies per bucket: weightsync merges copies that continue each other, as our
            # parameters do, and a tied weight is one tensor.
            version = self._receiver.receive_into(targets, loaded, timeout)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as err:
            message = f"weight update failed: {err}"
            if loaded:  # partly replaced weights: refuse to sample them
                self._broken = f"{message} (after loading {len(loaded)} tensors)"
            raise RolloutError(message) from err
        for name in loaded:
            self._dropped.pop(id(targets[name]), None)
        missing = sorted(self._dropped.values())
        self._broken = (
            f"weights dropped by sleep(level=2) not reloaded yet: {missing[:5]}" if missing else ""
        )
        self._version, self._sent = version, loaded
        return version

    def _tensors(self) -> dict:
        """Every parameter and buffer by name, tied names included (they share one tensor)."""
        return {
            **dict(self._model.named_buffers(remove_duplicate=False)),
            **dict(self._model.named_parameters(remove_duplicate=False)),
        }

    def weights_digest(self) -> str:
        """Return `ferrule_weightsync.digest` of the tensors, as held, that the last update named
        (before any update: every parameter, tied ones once). It equals the sender's digest of
        what it sent exactly when every tensor arrived bit for bit in the same dtype."""
        from ferrule_weightsync import digest

        with self._model_lock:
            tensors = self._tensors()
            names = self._sent or [name for name, _ in self._model.named_parameters()]
            return digest((name, tensors[name]) for name in names)

    # -- sleep, health, shutdown -----------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the GPU between rollouts. This waits for the running call, and new calls wait
        until wake_up. Level 1 moves the weights to host memory. Level 2 drops them; after
        wake_up, the engine generates again once a weight update has loaded every parameter.
        On CPU this is a no-op that logs so."""
        if level not in (1, 2):
            raise BadRequestError(f"sleep level must be 1 or 2, got {level!r}")
        if not self._can_sleep:
            logger.info("sleep: not supported on %s, nothing to free", self.device)
            return
        import torch

        self.pause("wait")
        with self._model_lock:
            if self._asleep:
                return
            self._drop_decoder()  # free its KV slab and graphs along with the weights
            if level == 1:
                self._model.to("cpu")
            else:  # in place, parameter by parameter: `.to("meta")` would untie tied weights
                self._shapes = {n: p.shape for n, p in self._model.named_parameters()}
                for param in self._model.parameters():
                    param.data = param.data.new_empty(0)  # buffers (rotary tables) stay
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._asleep = level

    def wake_up(self) -> None:
        if not self._can_sleep:
            logger.info("wake_up: not supported on %s, nothing to do", self.device)
            return
        with self._model_lock:
            if self._asleep == 1:
                self._lay_out_parameters()
                self._model.to(self.device)
            elif self._asleep == 2:
                self._lay_out_parameters(self._shapes)
                self._dropped = {id(p): name for name, p in self._model.named_parameters()}
                self._broken = "weights dropped by sleep(level=2): load a weight update first"
            self._asleep = 0
        self.resume()

    def _drop_decoder(self) -> None:
        """Free the decoder's KV slab and CUDA graphs now. The decoder and its steps refer to
        each other, so dropping the reference alone would leave them to the garbage collector."""
        if self._decoder is not None:
            self._decoder.release()
            self._decoder = None

    def _lay_out_parameters(self, empty: dict | None = None) -> None:
        """Put the parameters on the engine's device in one allocation per dtype, one after
        another in the model's order (tied ones once). A trainer's export comes in that order,
        and a ZeRO-3 policy of one rank also keeps its parameters in one allocation. Its
        in-place CUDA IPC update then loads with one copy instead of one per tensor
        (`Update.load_into` merges copies that continue each other). `empty` gives the shapes
        of parameters to allocate without copying (sleep level 2)."""
        self._drop_decoder()  # its graphs read the old storage
        params = list(self._model.named_parameters())
        entries = [(empty[name] if empty else p.shape, p.dtype) for name, p in params]
        placed = lay_out(entries, self.device)
        for (_, param), tensor in zip(params, placed, strict=True):
            if not empty:
                tensor.copy_(param.data)
            param.data = tensor

    def _counts(self) -> tuple[int, int]:
        return self._running, self._queued

    def close(self) -> None:
        """Let the calls in flight finish (waiting ones fail), then free the model."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._running)
        with self._update_lock, self._model_lock:
            if self._receiver is not None:
                self._receiver.close()
                self._receiver = None
            self._drop_decoder()
            self._model = None
