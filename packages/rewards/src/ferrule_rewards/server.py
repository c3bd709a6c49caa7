"""The reward gRPC server (grpc.aio): Score, health checking, reflection, limits and draining.

    server = await start(partial(FunctionScorer.load, "my_rewards:score"), "127.0.0.1:0")
    print(server.address); ...; await server.drain(grace=30)

    with BackgroundServer(make_scorer) as server:        # tests, or embedding in a process
        RewardClient(server.address).score(samples)

The server runs no reward function and decodes no request. It checks the token and the
limits, hands the request's bytes to a scoring process (processes.py, child.py), and passes the
answer's bytes back. So its event loop answers health checks and refusals within milliseconds,
whatever the requests hold or the function does. `make_scorer` (picklable) builds the scorer
in each scoring process.

`rlhf-rewards serve` (cli.py) calls `serve`, which drains on SIGTERM/SIGINT/SIGHUP: health turns
NOT_SERVING, new calls are refused with UNAVAILABLE, and calls in flight finish within the grace
period. With `--workers N`, workers.py runs N of these servers on one port. Every limit answers
at once with a status (RESOURCE_EXHAUSTED, INVALID_ARGUMENT), and nothing waits in an unbounded
queue. The concurrency limit answers before any of the request's body is read. The body is
read within the call's deadline before a scoring process is taken, so a slow sender never
holds a scoring process.
"""

import asyncio
import logging
import math
import os
import resource
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ferrule_grpc_auth import TLS, TokenInterceptor, check_bind, split_address
from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.front import Front
from ferrule_rewards.processes import CallFailed, ScoringProcesses
from ferrule_rewards.security import NO_TOKEN_METHODS, TOKEN_ENV
from ferrule_rewards.wire import OVER_LIMIT_CHUNK, InvalidRequest

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["RewardService"].full_name
MAX_MESSAGE_MB = 1024  # gRPC's limits are 32-bit signed byte counts
MAX_LOG_MB = 1024
MAX_SUB_SCORES = 1_000_000
# Each of these signals drains the server (SIGHUP once made it exit with status 129).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MAX_CONNECTIONS = 4096
"""The most connections open at once; gRPC closes new connections past this number. Each
connection costs a file descriptor, and the server needs some descriptors of its own to replace
a scoring process. (1020 idle connections under a systemd service's soft limit of 1024 made a
kill fail, and the process was lost for good.)"""
WRITE_GRACE = 1.0  # seconds past the call's deadline that its answer may take to be sent
HANDSHAKE_SECONDS = 5.0
"""Seconds a new connection has to finish its handshake (TLS, HTTP/2's preface) before it is
closed. A connection that sends nothing would otherwise hold a descriptor without a call."""
IDLE_SECONDS = 300.0
"""A connection with no call for this long is closed (GOAWAY; gRPC clients reconnect)."""
ANSWER_AHEAD = 0.25
"""Seconds before the client's deadline at which a call answers with the results it has, or a
quarter of the remaining time if that is less. 0.1 s was too little for the answer to reach the
client on a loaded 2-core machine (CI, in test_client.py's deadline test at a 1 s timeout)."""


@dataclass(frozen=True)
class Limits:
    max_batch: int = 4096
    """The most samples in one Score call. A larger call fails with INVALID_ARGUMENT (the
    client splits batches)."""
    max_message_bytes: int = 64 << 20
    """The largest request or response in bytes. gRPC itself answers a larger one with
    RESOURCE_EXHAUSTED."""
    max_concurrency: int = 32
    """The most Score calls admitted at once (being read, waiting for a scoring process, scored
    or answered). One more call fails with RESOURCE_EXHAUSTED (retry elsewhere) before any of
    its body is read, so at most this many requests are buffered in memory."""
    call_timeout: float = 60.0
    """Seconds a Score call may take, whatever its samples do; a shorter client deadline wins.
    Samples that have no result by then get TIMEOUT."""
    max_health_watches: int = 64
    """The most Health Watch streams open at once (they need no token). A further Watch fails
    with RESOURCE_EXHAUSTED."""
    max_log_bytes: int = 1 << 20
    """How many bytes of each scoring process's stdout and stderr (a function's prints) reach
    the server's log. The rest is dropped until the process is replaced; 0 drops all of it."""
    max_sub_scores: int = 1024
    """The most sub-scores one sample may return. A sample that returns more gets
    INVALID_REWARD."""
    max_connections_per_peer: int = 128
    """The most connections one peer (an IP address, or an IPv6 /64) may hold open. Further
    connections are reset on arrival (front.py). 0 leaves only the total bound,
    MAX_CONNECTIONS."""

    def __post_init__(self):
        for name in ("max_batch", "max_message_bytes", "max_concurrency", "max_health_watches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be 1 or more, got {getattr(self, name)}")
        if not 0 <= self.max_sub_scores <= MAX_SUB_SCORES:
            raise ValueError(f"max_sub_scores is {self.max_sub_scores}; 0 to {MAX_SUB_SCORES}")
        if not 0 <= self.max_connections_per_peer <= MAX_CONNECTIONS:
            raise ValueError(
                f"max_connections_per_peer is {self.max_connections_per_peer}; 0 to "
                f"{MAX_CONNECTIONS}"
            )
        if not 0 <= self.max_log_bytes <= MAX_LOG_MB << 20:
            raise ValueError(f"max_log_bytes is {self.max_log_bytes}; 0 to {MAX_LOG_MB} MiB")
        least = self.max_batch * len(OVER_LIMIT_CHUNK)  # every sample gets a result
        if least > self.max_message_bytes:
            raise ValueError(
                f"a batch of {self.max_batch} samples (--max-batch) needs a response of at "
                f"least {least} bytes ({len(OVER_LIMIT_CHUNK)} a sample), over the message "
                f"limit of {self.max_message_bytes} (--max-message-mb "
                f"{self.max_message_bytes / (1 << 20):.4g}); raise --max-message-mb to "
                f"{least / (1 << 20):.4g} or more, or lower --max-batch"
            )
        if self.max_message_bytes > MAX_MESSAGE_MB << 20:
            raise ValueError(
                f"max_message_bytes is {self.max_message_bytes}; at most {MAX_MESSAGE_MB} MiB"
            )
        if not (self.call_timeout > 0 and math.isfinite(self.call_timeout)):
            raise ValueError(
                f"call_timeout must be a number of seconds > 0, got {self.call_timeout}"
            )


class _Health(health.aio.HealthServicer):
    """The standard health service, with a bound on Watch streams: they need no token, and
    each one holds memory for as long as its client keeps it open."""

    def __init__(self, max_watches: int):
        super().__init__()
        self.watches, self.max_watches = 0, max_watches

    async def Watch(self, request, context):
        if self.watches >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watches} health Watch streams are open, this server's limit; use Check",
            )
        self.watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watches -= 1


class RewardServer:
    """A started server. Create it with `start`."""

    def __init__(self, processes: ScoringProcesses, limits: Limits):
        self.processes, self.limits = processes, limits
        self.address = ""
        self.health = _Health(limits.max_health_watches)
        self.busy = 0  # Score calls admitted: being read, scored, or answered
        self.draining = False
        self.cut_off = 0  # calls still running when the grace period ended
        self._server: grpc.aio.Server | None = None
        self._front: Front | None = None
        self._backend_dir: str | None = None
        processes.on_health_change = self._health_changed

    @property
    def name(self) -> str:
        return self.processes.name

    def _health_changed(self, healthy: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        log.warning("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
        self._health_update = asyncio.ensure_future(self._set_health(status))

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def _score(self, requests, context: grpc.aio.ServicerContext) -> None:
        """The Score method. It is registered as streaming both ways, which is the same on the
        wire as unary, so that nothing of the request is read before the checks below pass,
        and so that sending the answer can be awaited."""
        if self.draining or not self.processes.healthy:
            why = "shutting down" if self.draining else "unable to start its scoring processes"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"reward server is {why}")
        if self.busy >= self.limits.max_concurrency:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"reward server is busy: {self.busy} calls in progress, its limit; "
                "retry with backoff or use another replica",
            )
        self.busy += 1
        try:
            loop = asyncio.get_running_loop()
            budget = self.limits.call_timeout
            remaining = context.time_remaining()
            if remaining is not None:  # answer a little before the client stops waiting
                budget = min(budget, remaining - min(ANSWER_AHEAD, remaining / 4))
            deadline = loop.time() + budget
            body = await self._read(context, deadline)
            async with self.processes.process(deadline) as process:
                response = await process.score(body, deadline)
            del body
            await self._write(context, response, deadline)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except CallFailed as error:
            await context.abort(getattr(grpc.StatusCode, error.code), str(error))
        except asyncio.CancelledError:
            if self.draining:
                self.cut_off += 1
            raise
        finally:
            self.busy -= 1

    async def _write(self, context: grpc.aio.ServicerContext, response: bytes, deadline):
        """Send the answer. The call still counts against max_concurrency until the answer is
        sent: a client that never read its answers had ~50 of them held in memory against a
        limit of 32 (2.8 GiB). A call whose client has not taken the answer by the deadline
        (plus WRITE_GRACE) is cancelled."""
        wait = max(0.0, deadline - asyncio.get_running_loop().time()) + WRITE_GRACE
        try:
            await asyncio.wait_for(context.write(response), wait)
        except TimeoutError:
            log.warning("a client took no answer within its call's deadline; cancelled the call")
            raise asyncio.CancelledError from None
        except Exception:
            # The call ended first (its deadline passed, or its client left). grpc then raises
            # its private ExecuteBatchError, which gets logged loudly.
            raise asyncio.CancelledError from None

    async def _read(self, context: grpc.aio.ServicerContext, deadline: float):
        """Read the request's body before a scoring process is taken, within the call's
        deadline. A client that sends the body slowly, or never, holds one admission slot
        (max_concurrency) and no scoring process, and only until its deadline."""
        wait = deadline - asyncio.get_running_loop().time()
        try:
            body = await asyncio.wait_for(context.read(), max(0.0, wait))
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request did not arrive within the call's deadline ({wait:.3g}s)",
            )
        if body is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no ScoreRequest sent")
        return body

    async def drain(self, grace: float = 30.0) -> int:
        """Refuse new calls, let calls in flight finish (up to `grace` seconds), then stop.
        Returns how many calls were still running when the grace period ended (cancelled)."""
        if self.draining:
            return 0
        self.draining = True
        log.info("draining: %d call(s) in progress, grace %gs", self.busy, grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self.health.enter_graceful_shutdown()
        # Keep gRPC serving until the calls in flight are done: meanwhile `_score` answers new
        # calls UNAVAILABLE, which clients retry on another replica. A call that reaches a gRPC
        # server already stopping can come back CANCELLED instead (seen once in CI), which
        # clients rightly do not retry.
        while self.busy and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self._front is not None:
            self._front.stop_accepting()
        await self._server.stop(max(0.0, deadline - loop.time()))
        self._close_front()
        await self.processes.close()
        if self.cut_off:
            log.warning(
                "stopped: the grace period (%gs) ended with %d call(s) in flight; they were "
                "cancelled (their clients get CANCELLED)",
                grace,
                self.cut_off,
            )
        else:
            log.info("stopped")
        return self.cut_off

    async def wait(self) -> None:
        await self._server.wait_for_termination()

    def _close_front(self) -> None:
        if self._front is not None:
            self._front.close()
        if self._backend_dir is not None:
            shutil.rmtree(self._backend_dir, ignore_errors=True)


async def start(
    make_scorer,
    bind: str = "127.0.0.1:50051",
    *,
    token: str | None = None,
    tls: TLS | None = None,
    limits: Limits = Limits(),
    processes: int = 1,
    reuse_port: bool = False,
) -> RewardServer:
    """Start `processes` scoring processes, each of which builds its scorer with
    `make_scorer()`, and serve on `bind` (port 0 picks a free port; see `.address`). Raises
    processes.StartFailed when a scorer cannot be built. With `reuse_port`, the server shares
    the port with other servers that set it (the workers of workers.py)."""
    raise_descriptor_limit()
    check_bind(
        bind,
        token=token,
        client_auth=tls is not None and tls.client_ca is not None,
        token_env=TOKEN_ENV,
    )
    scoring = ScoringProcesses(
        make_scorer,
        processes,
        limits.max_batch,
        max_log_bytes=limits.max_log_bytes,
        max_sub_scores=limits.max_sub_scores,
        max_message_bytes=limits.max_message_bytes,
    )
    await scoring.start()
    try:
        return await _serve_grpc(RewardServer(scoring, limits), bind, token, tls, reuse_port)
    except BaseException:
        await scoring.close()
        raise


async def _serve_grpc(server: RewardServer, bind, token, tls, reuse_port) -> RewardServer:
    limits = server.limits
    grpc_server = grpc.aio.server(
        interceptors=[TokenInterceptor(token, NO_TOKEN_METHODS)] if token else None,
        options=[
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            # gRPC shares ports by default (SO_REUSEPORT): a second server on a busy port would
            # start silently and split the traffic. Fail instead, unless asked to share it.
            ("grpc.so_reuseport", int(reuse_port)),
            ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_SECONDS * 1000)),
            ("grpc.max_connection_idle_ms", int(IDLE_SECONDS * 1000)),
        ],
    )
    handler = grpc.stream_stream_rpc_method_handler(server._score)  # raw bytes in and out
    grpc_server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"Score": handler})]
    )
    health_pb2_grpc.add_HealthServicer_to_server(server.health, grpc_server)
    reflection.enable_server_reflection(
        [SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server
    )
    # gRPC bounds only the total number of connections. A bound per peer needs our own accept:
    # gRPC then listens on a Unix socket in a private directory, and the front relays to it
    # (front.py).
    front = limits.max_connections_per_peer > 0 and not bind.startswith("unix:")
    if front:
        server._backend_dir = tempfile.mkdtemp(prefix="ferrule-rewards-")
    listen = f"unix:{server._backend_dir}/grpc.sock" if front else bind
    try:
        if tls is None:
            port = grpc_server.add_insecure_port(listen)
        else:
            port = grpc_server.add_secure_port(listen, tls.server_credentials())
    except RuntimeError as error:  # gRPC raises this when it cannot bind
        server._close_front()
        raise OSError(f"cannot listen on {bind}: {error}") from None
    server._server = grpc_server
    await grpc_server.start()
    if front:
        host, wanted = split_address(bind)
        try:
            server._front = await Front.open(
                host,
                wanted,
                listen.removeprefix("unix:"),
                per_peer=limits.max_connections_per_peer,
                total=MAX_CONNECTIONS,
                reuse_port=reuse_port,
            )
        except OSError as error:
            await grpc_server.stop(None)
            server._close_front()
            raise OSError(f"cannot listen on {bind}: {error.strerror or error}") from None
        port = server._front.port
    if bind.startswith("unix:"):
        server.address = bind
    else:
        host, _ = split_address(bind)
        server.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    for name in ("", SERVICE):
        await server.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server


async def serve(
    make_scorer, bind: str, *, grace: float = 30.0, address_file: str | None = None, **options
) -> int:
    """Serve until SIGTERM, SIGINT or SIGHUP (a closed terminal, a log rotation), then drain.
    This is the `rlhf-rewards serve` main loop. Returns how many calls the grace period cut
    off."""
    server = await start(make_scorer, bind, **options)
    stop = stop_requested(STOP_SIGNALS)
    security = "TLS" if options.get("tls") else "plaintext"
    if address_file:  # before the log line: whoever reads the log may look for the file
        write_address(address_file, server.address)
    log.info("serving %s on %s (%s)", server.name, server.address, security)
    await stop.wait()
    return await server.drain(grace)


def raise_descriptor_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one: systemd gives a service 1024
    (soft), which idle connections alone could use up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def write_address(path: str, address: str) -> None:
    """Tell whoever started the server where it listens, once it accepts calls: `host:port` in
    `path`, renamed into place so a reader never sees half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


def stop_requested(signals: tuple[int, ...], watch: int | None = None) -> asyncio.Event:
    """Return an event that is set at the first of `signals`, or once the file descriptor
    `watch` turns readable (workers watch a pipe whose other end closes when the supervisor
    dies). Call it before announcing that the server serves: a signal that arrives before the
    handlers are set would kill the process."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    if watch is not None:
        loop.add_reader(watch, stop.set)
    return stop


class BackgroundServer:
    """A server on its own event loop in a daemon thread, for tests and for embedding in a
    process that is not asyncio. `.address` is where it listens; `.stop()` drains it."""

    def __init__(self, make_scorer, bind: str = "127.0.0.1:0", **options):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        try:
            self.server = self._run(start(make_scorer, bind, **options))
        except BaseException:
            self._close_loop()
            raise
        self.address = self.server.address

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def stop(self, grace: float = 5.0) -> None:
        if self._loop.is_running():
            self._run(self.server.drain(grace))
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
