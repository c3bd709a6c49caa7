"""The reward gRPC server (grpc.aio): Score, health checking, reflection, limits and draining.

    server = await start(scorer, "127.0.0.1:0")          # inside an event loop
    print(server.address); ...; await server.drain(grace=30)

    with BackgroundServer(scorer) as server:              # tests, or embedding in a process
        RewardClient(server.address).score(samples)

`rlhf-rewards serve` (cli.py) builds a scorer (functions.py or model.py) and calls `serve`, which
drains on SIGTERM/SIGINT: health turns NOT_SERVING, new calls are refused with UNAVAILABLE, and
calls in flight finish within the grace period. With `--workers N`, workers.py runs N of these
on one port. Every limit answers at once with a status
(RESOURCE_EXHAUSTED, INVALID_ARGUMENT); nothing waits in an unbounded queue.
"""

import asyncio
import logging
import os
import signal
import threading
from dataclasses import dataclass
from operator import attrgetter, methodcaller

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.records import Scores, Status
from ferrule_rewards.security import TokenInterceptor, check_bind, server_credentials, split_address

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["RewardService"].full_name
STATUS_TO_WIRE = {
    status: pb.SampleStatus.Value(f"SAMPLE_STATUS_{status.name}") for status in Status
}


@dataclass(frozen=True)
class Limits:
    max_batch: int = 4096
    """Most samples in one Score call; more is INVALID_ARGUMENT (the client splits batches)."""
    max_message_bytes: int = 64 << 20
    """Largest request or response; more is RESOURCE_EXHAUSTED, answered by gRPC itself."""
    max_concurrency: int = 32
    """Score calls being scored at once; one more is RESOURCE_EXHAUSTED (retry elsewhere)."""


@dataclass(frozen=True)
class TLS:
    cert: str
    key: str
    client_ca: str | None = None
    """With a client CA, clients must present a certificate it signed (mutual TLS)."""


class RewardServer:
    """A started server. Create it with `start`."""

    def __init__(self, scorer, limits: Limits):
        self.scorer, self.limits = scorer, limits
        self.address = ""
        self.health = health.aio.HealthServicer()
        self.busy = 0  # Score calls in progress
        self.draining = False
        self._server: grpc.aio.Server | None = None
        if hasattr(scorer, "on_health_change"):
            scorer.on_health_change = self._health_changed

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

    async def _score(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        # Limits first, before any work: a refused call costs the server almost nothing.
        if self.draining or not self.scorer.healthy:
            why = "shutting down" if self.draining else "stuck in the reward function"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"reward server is {why}")
        if self.busy >= self.limits.max_concurrency:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"reward server is busy: {self.busy} calls in progress, its limit; "
                "retry with backoff or use another replica",
            )
        try:
            samples = pb.ScoreRequest.FromString(request).samples
        except DecodeError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad ScoreRequest: {error}")
        n = len(samples)
        if n == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty batch: no samples")
        if n > self.limits.max_batch:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch of {n} samples is over this server's limit of {self.limits.max_batch}; "
                "split it into smaller calls",
            )
        self.busy += 1
        try:
            return await self._score_samples(samples)
        finally:
            self.busy -= 1

    async def _score_samples(self, samples) -> bytes:
        samples = list(samples)  # one Python wrapper per sample, reused by every pass below
        missing = [] if all(map(_HAS_RESPONSE, samples)) else _without_response(samples)
        if missing:  # score the others; these get their own status
            skip = set(missing)
            samples = [sample for i, sample in enumerate(samples) if i not in skip]
        rows = _rows(samples, self.scorer.fields)
        scores = await self.scorer.score(rows) if rows else Scores([])
        results = [{"reward": reward} for reward in scores.rewards]
        for index, (status, message) in scores.errors.items():
            results[index] = {"status": STATUS_TO_WIRE[status], "error": message}
        for index, subs in scores.sub_scores.items():
            results[index]["sub_scores"] = subs
        for index in missing:
            results.insert(index, _MISSING_RESPONSE)
        return pb.ScoreResponse(results=results).SerializeToString()

    async def drain(self, grace: float = 30.0) -> None:
        """Refuse new calls, let calls in flight finish (up to `grace` seconds), then stop."""
        if self.draining:
            return
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
        await self._server.stop(max(0.0, deadline - loop.time()))
        self.scorer.close()
        log.info("stopped")

    async def wait(self) -> None:
        await self._server.wait_for_termination()


_HAS_RESPONSE = methodcaller("HasField", "response")
_MISSING_RESPONSE = {
    "status": STATUS_TO_WIRE[Status.INVALID_SAMPLE],
    "error": "sample has no `response` (send an empty string for an empty generation)",
}
_CONTAINERS = {"metadata": dict, "prompt_token_ids": list, "response_token_ids": list}


def _without_response(samples) -> list[int]:
    return [index for index, sample in enumerate(samples) if not sample.HasField("response")]


def _rows(samples: list, fields: tuple[str, ...]) -> list[tuple]:
    """The fields a scorer takes, one tuple per sample. Only those fields are read: turning
    protobuf values into Python ones is most of the server's work on a large batch."""
    rows = list(map(attrgetter(*fields), samples))
    if len(fields) == 1:
        rows = [(value,) for value in rows]
    converts = [(i, _CONTAINERS[f]) for i, f in enumerate(fields) if f in _CONTAINERS]
    if converts:  # protobuf containers become plain dicts and lists
        rows = [list(row) for row in rows]
        for row in rows:
            for i, make in converts:
                row[i] = make(row[i])
        rows = [tuple(row) for row in rows]
    return rows


async def start(
    scorer,
    bind: str = "127.0.0.1:50051",
    *,
    token: str | None = None,
    tls: TLS | None = None,
    limits: Limits = Limits(),
    reuse_port: bool = False,
) -> RewardServer:
    """Start serving `scorer` on `bind` (port 0 picks a free port; see `.address`). With
    `reuse_port`, it shares the port with other servers that set it (the workers of workers.py)."""
    check_bind(bind, token=token, tls=tls is not None)
    server = RewardServer(scorer, limits)
    grpc_server = grpc.aio.server(
        interceptors=[TokenInterceptor(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            # gRPC shares ports by default (SO_REUSEPORT): a second server on a busy port would
            # start silently and split the traffic. Fail instead, unless asked to share it.
            ("grpc.so_reuseport", int(reuse_port)),
        ],
    )
    handler = grpc.unary_unary_rpc_method_handler(server._score)  # raw bytes in and out
    grpc_server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"Score": handler})]
    )
    health_pb2_grpc.add_HealthServicer_to_server(server.health, grpc_server)
    reflection.enable_server_reflection(
        [SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server
    )
    try:
        if tls is None:
            port = grpc_server.add_insecure_port(bind)
        else:
            port = grpc_server.add_secure_port(
                bind, server_credentials(tls.cert, tls.key, tls.client_ca)
            )
    except RuntimeError as error:  # gRPC raises this when it cannot bind
        raise OSError(f"cannot listen on {bind}: {error}") from None
    if bind.startswith("unix:"):
        server.address = bind
    else:
        host, _ = split_address(bind)
        server.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    server._server = grpc_server
    await grpc_server.start()
    for name in ("", SERVICE):
        await server.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server


async def serve(
    scorer, bind: str, *, grace: float = 30.0, address_file: str | None = None, **options
) -> None:
    """Serve until SIGTERM or SIGINT, then drain (the `rlhf-rewards serve` main loop)."""
    server = await start(scorer, bind, **options)
    security = "TLS" if options.get("tls") else "plaintext"
    if address_file:  # before the log line: whoever reads the log may look for the file
        write_address(address_file, server.address)
    log.info("serving %s on %s (%s)", scorer.name, server.address, security)
    await stop_requested((signal.SIGTERM, signal.SIGINT))
    await server.drain(grace)


def write_address(path: str, address: str) -> None:
    """Tell whoever started the server where it listens, once it accepts calls: `host:port` in
    `path`, renamed into place so a reader never sees half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


async def stop_requested(signals: tuple[int, ...], watch: int | None = None) -> None:
    """Return at the first of `signals`, or once the file descriptor `watch` turns readable
    (workers watch a pipe whose other end closes when the supervisor dies)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    if watch is not None:
        loop.add_reader(watch, stop.set)
    await stop.wait()


class BackgroundServer:
    """A server on its own event loop in a daemon thread, for tests and for embedding in a
    process that is not asyncio. `.address` is where it listens; `.stop()` drains it."""

    def __init__(self, scorer, bind: str = "127.0.0.1:0", **options):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        try:
            self.server = self._run(start(scorer, bind, **options))
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
