"""The gRPC front of a rollout engine, VLLMEngine or TransformersEngine
(proto/ferrule/rollout/v1/rollout.proto).

    server, port = serve(engine, "127.0.0.1:50052")      # a started RolloutServer
    server, port = serve(engine, "0.0.0.0:50052", token=token, tls=TLS(cert, key, client_ca))
    server.stop(grace=5).wait()

`rlhf-rollout serve` (cli.py) starts an engine and this server. Each call runs on a thread of the
server's pool and blocks on the engine. A VLLMEngine batches all calls together in its step loop;
a TransformersEngine runs them one at a time. Bad input gets INVALID_ARGUMENT with the engine's
message, and the server keeps serving. When a call ends early, because it was cancelled or passed
its deadline, its samples end with it (unary or streamed alike).

The server checks these limits before any work:
- `max_request_sequences`: prompts x n of one call;
- `max_sequences_in_flight`: sequences over every call at once (more gets RESOURCE_EXHAUSTED,
  and the client should retry later);
- `max_prompt_bytes`: a prompt's text, checked before it is tokenized;
- the model's length: a token-id prompt, checked before its ids are read;
- generation calls at once: the pool less the CONTROL_THREADS kept for health and control
  calls, which never wait behind generation.
A weight-sync join is given up when its call ends (the client left, the deadline passed, or the
server is stopping).

`stop(grace)` refuses new calls and ends generation in flight at once with UNAVAILABLE. A sample
stream seldom finishes within a grace period, and its client can retry on another engine. Other
calls in flight (weight updates, pause) get `grace` seconds.

The server is secure by default, as the reward server is (ferrule-grpc-auth): it listens on
loopback unless clients must authenticate, with a token or mutual TLS. The token is checked on
every call, including weight updates, pause / resume and health, before the call's request is
read. Whoever can update the weights decides what the engine generates.
"""

import logging
import threading
from concurrent import futures

import grpc

from ferrule_grpc_auth import TLS, SyncTokenInterceptor, check_bind
from ferrule_rollout import rollout_pb2 as pb
from ferrule_rollout import rollout_pb2_grpc
from ferrule_rollout.interface import Engine
from ferrule_rollout.joining import JoinAbandoned
from ferrule_rollout.samples import (
    BadRequestError,
    RolloutError,
    Sample,
    SamplingSettings,
    check_prompt_length,
)
from ferrule_rollout.security import TOKEN_ENV

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 256 * 2**20  # a batch of long samples can exceed gRPC's 4 MB default
# Handler threads kept for health and control calls (pause / resume, weight sync, sleep).
# Without them, when every thread of the pool was held by a Generate queued behind a pause,
# Resume itself queued behind those calls (a deadlock without client deadlines). Generation
# calls get the rest of the pool; past that, they are refused with RESOURCE_EXHAUSTED. 8 is more
# control calls than a trainer makes at once, and leaves health answerable beside them.
CONTROL_THREADS = 8
STATUS = {
    "serving": pb.HealthResponse.SERVING,
    "paused": pb.HealthResponse.PAUSED,
    "broken": pb.HealthResponse.BROKEN,
}


def settings_from_proto(message: pb.SamplingSettings) -> SamplingSettings:
    """Unset optional fields keep SamplingSettings' defaults."""
    fields = ("n", "temperature", "top_p", "top_k", "max_tokens", "seed")
    given = {name: getattr(message, name) for name in fields if message.HasField(name)}
    return SamplingSettings(**given, stop=tuple(message.stop), ignore_eos=message.ignore_eos)


def prompts_from_proto(
    prompts, max_prompt_bytes: int | None = None, max_model_len: int | None = None
) -> list:
    """Return the request's prompts as text or lists of token ids. A text longer than
    `max_prompt_bytes` is refused before the tokenizer sees it. A token-id prompt of
    `max_model_len` ids or more is refused before its ids become a Python list (10^8 ids took
    18 s and 2.5 GB to be refused at the engine's length check)."""
    result = []
    for index, prompt in enumerate(prompts):
        if prompt.text and prompt.token_ids:
            raise BadRequestError(f"prompt {index}: set text or token_ids, not both")
        size = len(prompt.text.encode()) if max_prompt_bytes else 0
        if max_prompt_bytes and size > max_prompt_bytes:  # checked before the tokenizer runs
            raise BadRequestError(
                f"prompt {index} is {size} bytes, more than this server's "
                f"--max-prompt-bytes {max_prompt_bytes}"
            )
        if max_model_len:
            check_prompt_length(index, len(prompt.token_ids), max_model_len)
        result.append(prompt.text if prompt.text else list(prompt.token_ids))
    return result


def sample_to_proto(sample: Sample) -> pb.Sample:
    return pb.Sample(
        prompt_index=sample.prompt_index,
        sample_index=sample.sample_index,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        finish_reason=sample.finish_reason,
        version=sample.version,
        text=sample.text,
        versions=[
            pb.VersionSpan(version=s.version, start=s.start, end=s.end) for s in sample.versions
        ],
        prompt_token_ids=sample.prompt_token_ids,
    )


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


class _Overloaded(Exception):
    """More sequences would be in flight than the server allows: RESOURCE_EXHAUSTED."""


class _ShuttingDown(Exception):
    """The server is stopping: UNAVAILABLE, which a client may retry on another engine."""

    def __init__(self):
        super().__init__("the rollout server is shutting down; retry on another")


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        engine: Engine,
        *,
        max_request_sequences: int = 4096,
        max_sequences_in_flight: int = 16384,
        max_prompt_bytes: int = 1 << 20,
        max_generation_calls: int = 64 - CONTROL_THREADS,
    ):
        self.engine = engine
        self.max_request_sequences = max_request_sequences
        self.max_sequences_in_flight = max_sequences_in_flight
        self.max_prompt_bytes = max_prompt_bytes
        self.max_generation_calls = max_generation_calls
        self._in_flight = 0
        self._calls = 0  # generation calls in flight, each holding a handler thread
        self._streams: set = set()  # the streams of calls still generating samples
        self._shutting_down = False
        self._lock = threading.Lock()

    def shut_down(self) -> None:
        """Refuse new generation calls and end the streams in flight (their calls get
        UNAVAILABLE)."""
        with self._lock:
            self._shutting_down = True
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()

    def _stream(self, request, context):
        """Check the call against the limits, then yield its samples as they finish. The
        samples end when the call ends."""
        max_model_len = getattr(self.engine, "max_model_len", None)
        prompts = prompts_from_proto(request.prompts, self.max_prompt_bytes, max_model_len)
        settings = settings_from_proto(request.sampling)
        count = len(prompts) * max(settings.n, 0)
        if count > self.max_request_sequences:
            raise BadRequestError(
                f"{len(prompts)} prompts x n = {settings.n} is {count} sequences, more than "
                f"this server's --max-request-sequences {self.max_request_sequences}"
            )
        with self._lock:
            if self._shutting_down:
                raise _ShuttingDown
            if self._calls >= self.max_generation_calls:
                raise _Overloaded(
                    f"{self._calls} generation calls in flight, this server's most "
                    f"(--max-workers less the {CONTROL_THREADS} threads kept for health and "
                    "control calls); retry later"
                )
            if self._in_flight + count > self.max_sequences_in_flight:
                raise _Overloaded(
                    f"{self._in_flight} sequences in flight and {count} asked for: more than "
                    f"this server's --max-sequences-in-flight {self.max_sequences_in_flight}; "
                    "retry later"
                )
            self._in_flight += count
            self._calls += 1
        stream = None
        try:
            stream = self.engine.generate_stream(prompts, settings)
            # The callback runs when the call ends for any reason, so a client that cancels (or
            # whose deadline passes) aborts the samples still running. It does nothing once all
            # samples were sent.
            context.add_callback(stream.cancel)
            with self._lock:
                self._streams.add(stream)
                if self._shutting_down:  # shut_down ran while the stream started
                    stream.cancel()
            sent = 0
            for sample in stream:
                sent += 1
                yield sample
            if sent < count and self._shutting_down:  # cut short by shut_down, not finished
                raise _ShuttingDown
        finally:
            with self._lock:
                self._in_flight -= count
                self._calls -= 1
                self._streams.discard(stream)

    def Generate(self, request, context):
        with _status(context):
            samples = sorted(
                self._stream(request, context), key=lambda s: (s.prompt_index, s.sample_index)
            )
            return pb.GenerateResponse(samples=[sample_to_proto(s) for s in samples])

    def GenerateStream(self, request, context):
        with _status(context):
            for sample in self._stream(request, context):
                yield sample_to_proto(sample)

    def InitWeightSync(self, request, context):
        with _status(context):
            timeout = _optional(request, "timeout_s")
            # Set when the call ends for any reason: a client that leaves (or whose deadline
            # passes), or the server stopping, gives up the wait for the sender at once.
            cancel = threading.Event()
            context.add_callback(cancel.set)
            self.engine.init_weight_sync(
                request.transport,
                request.host,
                request.port,
                rank=request.rank,
                num_receivers=request.num_receivers,
                timeout=300.0 if timeout is None else timeout,
                secret=_optional(request, "secret"),
                cancel=cancel,
            )
            return pb.InitWeightSyncResponse()

    def UpdateWeights(self, request, context):
        with _status(context):
            version = self.engine.update_weights(
                mode=request.pause_mode or "wait", timeout=_optional(request, "timeout_s")
            )
            return pb.UpdateWeightsResponse(version=version)

    def Pause(self, request, context):
        with _status(context):
            self.engine.pause(request.mode or "wait", timeout=_optional(request, "timeout_s"))
            return pb.PauseResponse()

    def Resume(self, request, context):
        with _status(context):
            self.engine.resume()
            return pb.ResumeResponse()

    def Sleep(self, request, context):
        with _status(context):
            self.engine.sleep(request.level or 1)
            return pb.SleepResponse()

    def WakeUp(self, request, context):
        with _status(context):
            self.engine.wake_up()
            return pb.WakeUpResponse()

    def Health(self, request, context):
        health = self.engine.health()
        return pb.HealthResponse(
            status=STATUS[health["status"]],
            detail=health["detail"],
            version=health["version"],
            model=health["model"],
            running=health["running"],
            queued=health["queued"],
        )


class _status:
    """Turn the engine's exceptions into gRPC status codes (context.abort raises)."""

    def __init__(self, context):
        self.context = context

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None or not isinstance(error, Exception):
            return False
        from ferrule_weightsync import PeerTimeoutError

        if isinstance(error, BadRequestError | ValueError):
            code = grpc.StatusCode.INVALID_ARGUMENT
        elif isinstance(error, _Overloaded):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        elif isinstance(error, _ShuttingDown):
            code = grpc.StatusCode.UNAVAILABLE
        elif isinstance(error, JoinAbandoned):  # the call had ended already
            code = grpc.StatusCode.CANCELLED
        elif isinstance(error, PeerTimeoutError) or isinstance(error.__cause__, PeerTimeoutError):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        elif isinstance(error, RolloutError):
            code = grpc.StatusCode.FAILED_PRECONDITION
        else:
            logger.exception("internal error")
            code = grpc.StatusCode.INTERNAL
        self.context.abort(code, str(error))


def serve(
    engine,
    bind: str = "127.0.0.1:50052",
    max_workers: int = 64,
    *,
    token: str | None = None,
    tls: TLS | None = None,
    **limits,
) -> tuple["RolloutServer", int]:
    """Start serving `engine` on `bind` (port 0 picks a free port); return the server and port.

    Before anything listens, raise InsecureBindError for an address beyond loopback where
    clients need not authenticate (neither `token` nor `tls` with a client CA). `limits` are
    RolloutServicer's max_request_sequences, max_sequences_in_flight and max_prompt_bytes. Of
    the `max_workers` handler threads, CONTROL_THREADS are kept for health and control calls,
    and the rest bound the number of generation calls at once."""
    if max_workers <= CONTROL_THREADS:
        raise ValueError(
            f"max_workers must be more than the {CONTROL_THREADS} threads kept for health and "
            f"control calls, got {max_workers}"
        )
    client_auth = tls is not None and tls.client_ca is not None
    check_bind(bind, token=token, client_auth=client_auth, token_env=TOKEN_ENV)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollout-grpc"),
        interceptors=[SyncTokenInterceptor(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    servicer = RolloutServicer(engine, max_generation_calls=max_workers - CONTROL_THREADS, **limits)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    if tls is None:
        port = server.add_insecure_port(bind)
    else:
        port = server.add_secure_port(bind, tls.server_credentials())
    if port == 0:
        raise RolloutError(f"could not bind the rollout server to {bind}")
    server.start()
    return RolloutServer(server, servicer), port


class RolloutServer:
    """A started gRPC server and its servicer. `stop` ends generation without waiting for the
    grace period."""

    def __init__(self, server: grpc.Server, servicer: RolloutServicer):
        self.server, self.servicer = server, servicer

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls. Generation in flight ends now with UNAVAILABLE, and other calls get
        `grace` seconds. The returned event is set once every call has ended."""
        stopped = self.server.stop(grace)
        self.servicer.shut_down()
        return stopped
