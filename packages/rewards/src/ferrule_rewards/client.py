"""The Python client for ferrule-rewards servers: deadlines, retries, several addresses.

    with RewardClient(["10.0.0.5:50051", "10.0.0.6:50051"], token=token) as client:
        results = client.score([{"prompt": p, "response": r, "label": a}, ...])
        rewards = [result.reward for result in results]    # NaN where not result.ok

A sample is a dict with the wire format's field names, or a `records.Sample`. A call larger
than `batch_size` is split into chunks that go out concurrently. The chunks are spread
round-robin over the addresses and over several connections to each address: a server with
`--workers N` is N processes, and each connection reaches one of them. A chunk refused with
UNAVAILABLE (server down or draining) or RESOURCE_EXHAUSTED (server busy) moves to the next
address at once. Once every address has refused the chunk, the client backs off exponentially.
After `retry_for` seconds of refusals, RewardServersUnavailable lists what each address said.
Other failures raise RewardError at once, DEADLINE_EXCEEDED included: a call that timed out
may still be running on the server, and retrying it would score its samples twice.
"""

import itertools
import math
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import grpc

from ferrule_grpc_auth import bearer, channel_credentials
from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.records import Result, Sample, Status
from ferrule_rewards.security import TOKEN_ENV

METHOD = "/{}/Score".format(pb.DESCRIPTOR.services_by_name["RewardService"].full_name)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
STATUS_FROM_WIRE = {pb.SampleStatus.Value(f"SAMPLE_STATUS_{s.name}"): s for s in Status}
NAN = math.nan


class RewardError(Exception):
    """A Score call failed. `code` is the gRPC status code, `address` the server that said so."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, address: str = ""):
        super().__init__(message)
        self.code, self.address = code, address


class RewardServersUnavailable(RewardError):
    """No server could take the call: every attempt was refused or could not connect."""


class InvalidSample(ValueError):
    """A sample that the wire format cannot carry, found before anything is sent. `index` is
    the sample's position in the samples given to `score`."""

    def __init__(self, index: int, message: str):
        super().__init__(f"sample {index}: {message}")
        self.index, self.message = index, message


class RewardClient:
    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        timeout: float = 60.0,
        retry_for: float = 30.0,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        cooldown: float = 1.0,
        batch_size: int = 256,
        max_in_flight: int = 8,
        connections_per_address: int | None = None,
        max_message_bytes: int = 64 << 20,
    ):
        """addresses: one `host:port` or several replicas of the same server.
        token: sent as `authorization: Bearer <token>`; default $FERRULE_REWARDS_TOKEN.
        tls, tls_ca, tls_cert, tls_key: TLS (on when any is given); `tls_ca` verifies the
            server (default: system roots), `tls_cert`/`tls_key` are for mutual TLS.
        tls_server_name: the name the server certificate must carry, when not the host.
        timeout: deadline of each attempt, in seconds.
        retry_for: seconds a chunk keeps being retried while every address refuses it.
        backoff, max_backoff: first and largest pause after all addresses refused a chunk.
        cooldown: seconds for which an address that answered UNAVAILABLE is tried last.
        batch_size: samples per call; larger score() calls are split.
        max_in_flight: chunks of one score() call sent concurrently.
        connections_per_address: HTTP/2 connections to each address; chunks go round-robin
            over them (default: max_in_flight). A connection stays with the server process
            that accepted it. For `rlhf-rewards serve --workers N`, the kernel assigns each
            connection to one of the N processes by hash. With one connection per chunk in
            flight, the chunks of one score() call can each reach a different worker, and
            several clients spread evenly over the workers. Against a single process, each
            extra connection costs a socket. Connections open on first use.
        """
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("RewardClient needs at least one server address")
        connections = connections_per_address or max_in_flight
        if connections < 1:
            raise ValueError(f"connections_per_address must be 1 or more, got {connections}")
        self.timeout, self.retry_for, self.batch_size = timeout, retry_for, batch_size
        self.backoff, self.max_backoff, self.cooldown = backoff, max_backoff, cooldown
        token = token or os.environ.get(TOKEN_ENV)
        self._metadata = bearer(token)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Reconnect soon after a replica comes back (gRPC's default waits up to 2 min).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 5000),
            # One connection per channel: otherwise gRPC shares a connection between channels
            # with equal arguments.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        secure = tls or any((tls_ca, tls_cert, tls_key))
        credentials = channel_credentials(tls_ca, tls_cert, tls_key) if secure else None
        self._channels = {
            address: [
                grpc.secure_channel(address, credentials, options)
                if secure
                else grpc.insecure_channel(address, options)
                for _ in range(connections)
            ]
            for address in self.addresses
        }
        # Requests go out already serialized: each chunk is serialized once, however often it
        # is retried.
        self._calls = {
            address: [
                channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
                for channel in channels
            ]
            for address, channels in self._channels.items()
        }
        # Round-robin counters over the addresses, and over the connections of each address.
        # next() on them is atomic in CPython.
        self._turn = itertools.count()
        self._spread = {address: itertools.count() for address in self.addresses}
        self._down_until: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="reward-client")
        self._lock = threading.Lock()

    def score(self, samples: Iterable[Mapping | Sample]) -> list[Result]:
        """Score every sample; one Result per sample, in order."""
        samples, size = list(samples), self.batch_size
        chunks = [samples[start : start + size] for start in range(0, len(samples), size)]
        requests = [_encode(chunk, i * size) for i, chunk in enumerate(chunks)]
        if len(chunks) == 1:
            return self._call(requests[0], len(chunks[0]))
        futures = [
            self._pool.submit(self._call, request, len(chunk))
            for request, chunk in zip(requests, chunks, strict=True)
        ]
        try:
            return [result for future in futures for result in future.result()]
        finally:
            for future in futures:
                future.cancel()

    def _order(self) -> list[str]:
        """The addresses to try for the next chunk, from the next round-robin start, with the
        recently unavailable addresses last."""
        start = next(self._turn) % len(self.addresses)
        order = self.addresses[start:] + self.addresses[:start]
        now = time.monotonic()
        with self._lock:
            return sorted(order, key=lambda address: self._down_until.get(address, 0) > now)

    def _call(self, request: bytes, n: int) -> list[Result]:
        order = self._order()
        refusals: dict[str, str] = {}
        give_up = time.monotonic() + self.retry_for
        for attempt in itertools.count():
            round_, position = divmod(attempt, len(order))
            if round_ and not position:  # every address refused this chunk: back off
                pause = min(self.max_backoff, self.backoff * 2 ** (round_ - 1))
                pause *= random.uniform(0.5, 1.0)  # jitter, so clients do not retry in lockstep
                if time.monotonic() + pause > give_up:
                    break
                time.sleep(pause)
            address = order[position]
            calls = self._calls[address]
            call = calls[next(self._spread[address]) % len(calls)]
            try:
                response = call(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as error:
                code, details = error.code(), error.details() or ""
                if code not in RETRYABLE or "larger than max" in details:  # too big for all
                    raise RewardError(f"{address}: {code.name}: {details}", code, address) from None
                refusals[address] = f"{code.name}: {details}"
                if code is grpc.StatusCode.UNAVAILABLE:
                    with self._lock:
                        self._down_until[address] = time.monotonic() + self.cooldown
                continue
            return _decode(response, n, address)
        said = "; ".join(f"{address}: {why}" for address, why in refusals.items())
        raise RewardServersUnavailable(
            f"no reward server took a batch of {n} samples in {attempt} attempts over "
            f"{len(order)} address(es) and {self.retry_for:g}s: {said}",
            grpc.StatusCode.UNAVAILABLE,
        )

    def health(self, timeout: float = 5.0) -> dict[str, str]:
        """Each address's answer to the standard gRPC health check: SERVING, NOT_SERVING, or
        UNREACHABLE and why."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        answers = {}
        for address, channels in self._channels.items():
            check = health_pb2_grpc.HealthStub(channels[0]).Check
            try:
                status = check(health_pb2.HealthCheckRequest(), timeout=timeout).status
                answers[address] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as error:
                answers[address] = f"UNREACHABLE: {error.code().name}: {error.details()}"
        return answers

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channels in self._channels.values():
            for channel in channels:
                channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _encode(samples: list, offset: int) -> bytes:
    """Serialize a chunk. Dicts go to protobuf as they are, because protobuf's C code converts
    them fastest. A bad sample raises InvalidSample (a ValueError) that names the sample."""
    samples = [asdict(s) if isinstance(s, Sample) else s for s in samples]
    try:
        return pb.ScoreRequest(samples=samples).SerializeToString()
    except (ValueError, TypeError, UnicodeError):
        for index, sample in enumerate(samples):
            try:
                pb.Sample(**sample)
            except (ValueError, TypeError, UnicodeError) as error:
                raise InvalidSample(offset + index, _what_is_wrong(sample, error)) from None
        raise


def _what_is_wrong(sample, error: Exception) -> str:
    """The field of `sample` that protobuf refused, and why. Protobuf's own message (`bad
    argument type for built-in operation`) names no field."""
    if not isinstance(sample, Mapping):
        return f"a {type(sample).__name__}, not a dict of the sample's fields"
    for key, value in sample.items():
        try:
            pb.Sample(**{key: value})
        except (ValueError, TypeError, UnicodeError) as field_error:
            shown = repr(value) if isinstance(value, int | float | bool) else type(value).__name__
            return f"field {key!r} ({shown}): {field_error}"
    return str(error)


def _decode(response: pb.ScoreResponse, n: int, address: str) -> list[Result]:
    if len(response.results) != n:
        raise RewardError(f"{address}: returned {len(response.results)} results for {n} samples")
    results = []
    for result in response.results:
        if result.status == 0:  # SAMPLE_STATUS_OK
            subs = dict(result.sub_scores) if result.sub_scores else {}
            results.append(Result(result.reward, Status.OK, "", subs))
        else:
            status = STATUS_FROM_WIRE.get(result.status, Status.ERROR)
            error = result.error or f"sample status {result.status}"
            results.append(Result(NAN, status, error, dict(result.sub_scores)))
    return results
