"""The server over the wire, in process on loopback: bad input, limits, health, reflection,
draining, and a hypothesis fuzz of request handling."""

import math
import threading
import time
from functools import partial
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.client import METHOD, RewardClient
from ferrule_rewards.server import Limits

SERVICE = "ferrule.rewards.v1.RewardService"
TESTS = Path(__file__).resolve().parent


def raw_call(address: str, request: bytes, timeout: float = 10) -> pb.ScoreResponse:
    """One Score call with the bytes as they are: no client library in between."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        return call(request, timeout=timeout)


def status_of(address: str, request: bytes) -> tuple[grpc.StatusCode, str]:
    try:
        raw_call(address, request)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def request(*samples: dict) -> bytes:
    return pb.ScoreRequest(samples=list(samples)).SerializeToString()


def health_of(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_scores_come_back_in_order_with_sub_scores(serve):
    server = serve("every_field")
    with RewardClient(server.address) as client:
        results = client.score(
            [
                {"prompt": "ab", "response": "c", "prompt_token_ids": [1], "label": "x"},
                {"response": "", "metadata": {"a": "1", "b": "2"}},
            ]
        )
    assert [r.reward for r in results] == [3.0, 0.0]
    assert results[0].sub_scores == {"tokens": 1.0, "has_label": 1.0, "metadata_keys": 0.0}
    assert results[1].sub_scores["metadata_keys"] == 2.0
    assert all(r.ok for r in results)


def test_bad_requests_get_the_right_status_and_the_server_keeps_serving(serve):
    server = serve(limits=Limits(max_batch=8, max_message_bytes=1 << 16))
    address = server.address
    good = request({"response": "abc"})
    bad_utf8 = good.replace(b"abc", b"a\xffc")
    cases = {
        "empty batch": (request(), grpc.StatusCode.INVALID_ARGUMENT, "empty batch"),
        "over max batch": (
            request(*[{"response": "x"}] * 9),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch of 9 samples is over this server's limit of 8",
        ),
        "invalid UTF-8": (bad_utf8, grpc.StatusCode.INVALID_ARGUMENT, "bad UTF-8"),
        "not protobuf": (b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "ScoreRequest"),
        "truncated": (good[:-1], grpc.StatusCode.INVALID_ARGUMENT, "ScoreRequest"),
        "oversized": (
            request({"response": "x" * (1 << 17)}),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
    }
    for name, (body, code, message) in cases.items():
        got, details = status_of(address, body)
        assert (got, name) == (code, name), details
        assert message in details, (name, details)
    assert raw_call(address, good).results[0].reward == 3.0
    assert health_of(address) == health_pb2.HealthCheckResponse.SERVING


def test_bad_samples_get_a_status_of_their_own(serve):
    server = serve("misbehaving", timeout=0.3)
    responses = ["ok", "raise", "nan", "inf", "hang", "text"]
    samples = [{"response": r} for r in responses] + [{"prompt": "no response"}]
    results = raw_call(server.address, request(*samples)).results
    statuses = [pb.SampleStatus.Name(r.status) for r in results]
    assert statuses == [
        "SAMPLE_STATUS_OK",
        "SAMPLE_STATUS_ERROR",
        "SAMPLE_STATUS_INVALID_REWARD",
        "SAMPLE_STATUS_INVALID_REWARD",
        "SAMPLE_STATUS_TIMEOUT",
        "SAMPLE_STATUS_INVALID_REWARD",
        "SAMPLE_STATUS_INVALID_SAMPLE",
    ]
    assert results[0].reward == 2.0 and not results[0].error
    assert "asked to raise" in results[1].error
    assert "no `response`" in results[6].error
    assert raw_call(server.address, request({"response": "abc"})).results[0].reward == 3.0


def test_a_missing_label_is_a_per_sample_error(serve):
    from ferrule_rewards.functions import FunctionScorer
    from ferrule_rewards.server import BackgroundServer

    scorer = partial(FunctionScorer.load, "ferrule_rewards.builtin:exact_match")
    with BackgroundServer(scorer) as server, RewardClient(server.address) as client:
        results = client.score([{"response": "#### 4", "label": "4"}, {"response": "#### 4"}])
    assert results[0].reward == 1.0
    assert not results[1].ok and math.isnan(results[1].reward)
    assert "needs the reference answer" in results[1].error


def test_concurrency_limit_refuses_at_once_instead_of_queueing(serve):
    server = serve("slow", limits=Limits(max_concurrency=2))
    outcomes = []

    def slow_call():
        outcomes.append(status_of(server.address, request({"response": "1.0"}))[0])

    callers = [threading.Thread(target=slow_call) for _ in range(2)]
    for caller in callers:
        caller.start()
    deadline = time.monotonic() + 5
    while server.server.busy < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    code, details = status_of(server.address, request({"response": "0"}))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "busy: 2 calls in progress" in details
    assert time.monotonic() - started < 0.5  # refused, not queued behind the slow calls
    for caller in callers:
        caller.join()
    assert outcomes == [grpc.StatusCode.OK] * 2


def test_a_hang_that_holds_the_gil_freezes_neither_the_server_nor_the_other_samples(serve):
    """A catastrophic regular expression holds the GIL: in a thread of the server's process it
    froze health checks and every other call. In a scoring process, the server answers, kills
    that process at the timeout, and a new one scores the rest."""
    server = serve("misbehaving", timeout=1.0)
    outcome = {}
    caller = threading.Thread(
        target=lambda: outcome.update(
            reply=raw_call(
                server.address, request(*[{"response": r} for r in ("ab", "gil", "abc")])
            )
        )
    )
    started = time.monotonic()
    caller.start()
    while time.monotonic() - started < 0.8:  # while the regular expression runs
        asked = time.monotonic()
        assert health_of(server.address) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - asked < 0.2
        time.sleep(0.05)
    caller.join()
    assert time.monotonic() - started < 3.0
    results = outcome["reply"].results
    assert [r.reward for r in (results[0], results[2])] == [2.0, 3.0]
    assert results[1].status == pb.SAMPLE_STATUS_TIMEOUT and "1s" in results[1].error
    assert raw_call(server.address, request({"response": "x"})).results[0].reward == 1.0


def test_a_call_is_bounded_by_its_deadline_whatever_its_samples_do(serve):
    """Samples run one after another: three that each take just under the per-sample timeout
    held a call for three timeouts. The call's own limit bounds it."""
    server = serve("misbehaving", timeout=1.0, limits=Limits(call_timeout=1.5))
    started = time.monotonic()
    samples = [{"response": r} for r in ("hang0.9", "ok", "hang0.9", "hang0.9", "abc")]
    results = raw_call(server.address, request(*samples)).results
    assert time.monotonic() - started < 2.2
    assert [pb.SampleStatus.Name(r.status)[14:] for r in results] == [
        "OK", "OK", "TIMEOUT", "TIMEOUT", "TIMEOUT"
    ]  # fmt: skip
    assert "deadline passed" in results[3].error
    assert raw_call(server.address, request({"response": "x"})).results[0].reward == 1.0


def test_a_cancelled_call_stops_its_work_and_frees_its_place(serve, tmp_path, monkeypatch):
    """A cancelled call stopped counting as busy while its samples kept running (150 calls with a
    30 ms deadline left 138 threads burning CPU). Now its process is killed and replaced; a call
    whose deadline comes first gets TIMEOUT for what is not done."""
    log = tmp_path / "pids"
    monkeypatch.setenv("REWARDS_TEST_LOG", str(log))
    server = serve("pid", limits=Limits(max_concurrency=2))
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        for _ in range(5):
            pending = call.future(request({"response": "30"}))
            time.sleep(0.4)
            pending.cancel()
            deadline = time.monotonic() + 5
            while server.server.busy:  # the place is free once the server saw the cancel
                assert time.monotonic() < deadline
                time.sleep(0.01)
        reply = call(request({"response": "30"}, {"response": ""}), timeout=0.5)
    assert [pb.SampleStatus.Name(r.status)[14:] for r in reply.results] == ["TIMEOUT"] * 2
    pids = [int(line) for line in log.read_text().split()]
    # Each call got a fresh process (the last call's second sample may never have started).
    assert 5 <= len(pids) <= 6 and len(set(pids)) == len(pids)
    time.sleep(0.5)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{pid} still runs"
    started = time.monotonic()
    assert raw_call(server.address, request({"response": ""})).results[0].reward == 1.0
    assert time.monotonic() - started < 2.0
    assert server.server.busy == 0


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_a_scorer_that_cannot_be_rebuilt_turns_the_server_unhealthy_until_it_can(tmp_path):
    """When a scoring process must be replaced and its replacement fails to start, the server
    reports NOT_SERVING and refuses calls with UNAVAILABLE, retrying; it serves again once a
    process starts."""
    from ferrule_rewards.functions import FunctionScorer
    from ferrule_rewards.server import BackgroundServer

    broken = tmp_path / "broken"
    module = tmp_path / "flaky.py"
    module.write_text(
        "import pathlib, time\n"
        f"if pathlib.Path({str(broken)!r}).exists():\n"
        "    raise RuntimeError('broken on purpose')\n"
        "def reward(response):\n"
        "    time.sleep(float(response or 0))\n"
        "    return 1.0\n"
    )
    scorer = partial(FunctionScorer.load, f"{module}:reward", timeout=0.3)
    with BackgroundServer(scorer) as server:
        broken.touch()
        assert raw_call(server.address, request({"response": "5"})).results[0].status == (
            pb.SAMPLE_STATUS_TIMEOUT
        )
        deadline = time.monotonic() + 10
        while health_of(server.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, details = status_of(server.address, request({"response": ""}))
        assert code == grpc.StatusCode.UNAVAILABLE and "scoring processes" in details
        broken.unlink()
        deadline = time.monotonic() + 15
        while health_of(server.address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert raw_call(server.address, request({"response": ""})).results[0].reward == 1.0


def test_a_replacement_that_fails_other_than_in_its_scorer_is_retried_not_lost(
    fn_spec, monkeypatch
):
    """A scoring process's replacement that fails with an OSError (out of file descriptors,
    say) once its child is running is retried after the child is reaped: the pool keeps its
    slot (it used to lose it for good, and every later call waited for the other processes)
    and leaves no zombie behind."""
    import asyncio
    import os

    from ferrule_rewards.functions import FunctionScorer
    from ferrule_rewards.processes import ScoringProcess, ScoringProcesses
    from ferrule_rewards.tree import descendants

    real_start, starts = ScoringProcess.start, []

    async def start_then_fail_once(self):
        ready = await real_start(self)
        starts.append(self.process.pid)
        if len(starts) == 2:  # the first replacement
            raise OSError(24, "Too many open files")
        return ready

    monkeypatch.setattr(ScoringProcess, "start", start_then_fail_once)

    async def main():
        pool = ScoringProcesses(partial(FunctionScorer.load, fn_spec("length")), processes=1)
        await pool.start()
        loop = asyncio.get_running_loop()
        async with pool.process(loop.time() + 5) as process:
            process.recycle = True  # replaced after this call, as a process that asked to be
        async with pool.process(loop.time() + 10) as process:  # the replacement's second try
            assert process.alive and process.process.pid == starts[-1]
            running = descendants(os.getpid())
        await pool.close()
        return running

    running = asyncio.run(main())
    assert len(starts) == 3
    assert starts[0] not in running and starts[1] not in running  # killed and reaped
    assert starts[2] in running


def test_a_start_that_cannot_spawn_leaks_no_descriptor(fn_spec, monkeypatch):
    """Popen failing (out of processes, say) fails the start and closes what it opened for the
    child, its socket pair and output pipe: the pool retries starts, and each failed one used to
    leave the pipe's two descriptors open (the sockets until collected), until the server ran
    out of them."""
    import asyncio
    import os
    import subprocess

    from ferrule_rewards.functions import FunctionScorer
    from ferrule_rewards.processes import ScoringProcess, ScoringProcesses

    def cannot_spawn(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    async def main():
        pool = ScoringProcesses(partial(FunctionScorer.load, fn_spec("length")), processes=1)
        process = ScoringProcess(pool)
        monkeypatch.setattr(subprocess, "Popen", cannot_spawn)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            with pytest.raises(BlockingIOError):
                await process.start()
            await process.stop()  # closes the start's shared-memory mark, as a restart does
        return len(os.listdir("/proc/self/fd")) - before

    assert asyncio.run(main()) == 0


def test_health_and_reflection_services(serve):
    server = serve()
    assert health_of(server.address) == health_pb2.HealthCheckResponse.SERVING
    assert health_of(server.address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in database.get_services()


def test_a_client_built_from_reflection_alone(serve):
    """A caller with nothing of ours, not even the generated code: it learns the messages from
    the server's reflection service and builds them from those descriptors."""
    server = serve()
    with grpc.insecure_channel(server.address) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName(SERVICE).FindMethodByName("Score")
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        score = channel.unary_unary(
            f"/{SERVICE}/Score",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        response = score(request_class(samples=[{"response": "four"}, {}]), timeout=10)
    assert response.results[0].reward == 4.0
    status = response.results[1].DESCRIPTOR.fields_by_name["status"].enum_type
    assert status.values_by_number[response.results[1].status].name == (
        "SAMPLE_STATUS_INVALID_SAMPLE"
    )


def test_stopping_drains_calls_in_flight_and_refuses_new_ones(serve):
    server = serve("slow")
    outcome = {}

    def in_flight():
        outcome["reply"] = raw_call(server.address, request({"response": "1.0"}))

    caller = threading.Thread(target=in_flight)
    caller.start()
    while server.server.busy < 1:
        time.sleep(0.01)
    stopper = threading.Thread(target=server.stop, kwargs={"grace": 10})
    stopper.start()
    while not server.server.draining:
        time.sleep(0.01)
    code, _ = status_of(server.address, request({"response": "0"}))
    assert code == grpc.StatusCode.UNAVAILABLE
    caller.join()
    stopper.join()
    assert outcome["reply"].results[0].reward == 1.0  # the call in flight finished


# Text that protobuf can carry (no lone surrogates), from every Unicode plane.
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
SAMPLE = st.fixed_dictionaries(
    {},
    optional={
        "prompt": TEXT,
        "response": TEXT,
        "label": TEXT,
        "prompt_token_ids": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5),
        "response_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=5),
        "metadata": st.dictionaries(TEXT, TEXT, max_size=3),
    },
)
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(samples=st.lists(SAMPLE, max_size=12))
def test_fuzz_well_formed_requests(serve_once, samples):
    """Any well-formed request gets one result per sample, or INVALID_ARGUMENT when empty."""
    if not samples:
        assert status_of(serve_once, request())[0] == grpc.StatusCode.INVALID_ARGUMENT
        return
    results = raw_call(serve_once, request(*samples)).results
    assert len(results) == len(samples)
    for sample, result in zip(samples, results, strict=True):
        if "response" in sample:
            assert result.status == pb.SAMPLE_STATUS_OK
            assert result.reward == len(sample["response"])
        else:
            assert result.status == pb.SAMPLE_STATUS_INVALID_SAMPLE


@FUZZ
@given(body=st.one_of(st.binary(max_size=200), st.lists(SAMPLE, min_size=1, max_size=4).map(
    lambda samples: _mutate(request(*samples)))))  # fmt: skip
def test_fuzz_arbitrary_bytes(serve_once, body):
    """Random or corrupted bytes: OK or INVALID_ARGUMENT, never an internal error, and the
    server keeps answering."""
    code, details = status_of(serve_once, body)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), details


def _mutate(body: bytes) -> bytes:
    """Flip one byte in the middle of a valid request."""
    if not body:
        return body
    middle = len(body) // 2
    return body[:middle] + bytes([body[middle] ^ 0xA5]) + body[middle + 1 :]


@pytest.fixture(scope="module")
def serve_once():
    """One server for all fuzz examples (hypothesis runs them in one test call)."""
    from ferrule_rewards.functions import FunctionScorer
    from ferrule_rewards.server import BackgroundServer

    server = BackgroundServer(partial(FunctionScorer.load, f"{TESTS}/reward_fns.py:length"))
    yield server.address
    assert health_of(server.address) == health_pb2.HealthCheckResponse.SERVING
    server.stop(grace=0)


def test_a_kill_that_cannot_list_proc_still_kills_and_the_slot_comes_back(serve, monkeypatch):
    """Out of descriptors (1020 idle connections under a soft limit of 1024), listing /proc
    failed with EMFILE inside a kill at the call's deadline: the kill raised, the restart task
    died, and the only scoring process never came back (every later call DEADLINE_EXCEEDED,
    health SERVING). Now the process is frozen, the kill tried again, and the slot restored."""
    from ferrule_rewards import tree

    server = serve("slow", processes=1, timeout=10.0)
    real, failures = tree.descendants, []

    def out_of_descriptors(pid):
        if len(failures) < 3:
            failures.append(pid)
            raise OSError(24, "Too many open files", f"/proc/{pid}/task")
        return real(pid)

    monkeypatch.setattr(tree, "descendants", out_of_descriptors)
    with pytest.raises(grpc.RpcError) as error:
        raw_call(server.address, request({"response": "4"}), timeout=1.0)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failures
    for _ in range(3):
        assert (
            raw_call(server.address, request({"response": "0"}), timeout=8).results[0].reward == 1
        )
    assert health_of(server.address) == health_pb2.HealthCheckResponse.SERVING
    assert not Path(f"/proc/{failures[0]}").exists()  # killed and reaped


def test_connections_are_bounded_and_silent_ones_are_closed(serve, monkeypatch):
    """Idle connections that never sent a byte were kept for good, each holding a descriptor,
    and nothing bounded how many: with 1024 descriptors they starved the server. Now past
    MAX_CONNECTIONS a new one is closed at once, and one silent past HANDSHAKE_SECONDS is
    closed; calls on fresh connections are still answered."""
    import socket

    from ferrule_rewards import server as server_module

    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 8, raising=False)
    monkeypatch.setattr(server_module, "HANDSHAKE_SECONDS", 0.5, raising=False)
    server = serve()
    host, port = server.address.rsplit(":", 1)
    sockets = [socket.create_connection((host, int(port))) for _ in range(12)]
    closed_at = {}
    started = time.monotonic()
    while len(closed_at) < len(sockets) and time.monotonic() - started < 5:
        for index, sock in enumerate(sockets):
            sock.setblocking(False)
            try:
                if index not in closed_at and sock.recv(64) == b"":
                    closed_at[index] = time.monotonic() - started
            except BlockingIOError:
                pass
            except ConnectionError:
                closed_at[index] = time.monotonic() - started
        time.sleep(0.02)
    for sock in sockets:
        sock.close()
    assert len(closed_at) == 12, closed_at
    assert sorted(closed_at.values())[3] < 0.4  # the 4 past the bound: at once
    assert max(closed_at.values()) < 2.0
    assert raw_call(server.address, request({"response": "abc"})).results[0].reward == 3.0


def _connect_from(source: str, address: str):
    """A raw TCP connection to `address` from the loopback address `source` (Linux answers on
    all of 127.0.0.0/8): a second peer on one machine."""
    import socket

    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect((host, int(port)))
    return sock


def _reset_within(sock, seconds: float) -> bool:
    """True when the server closes or resets `sock` within `seconds`, without a byte sent."""
    sock.settimeout(seconds)
    try:
        return sock.recv(64) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def test_one_peer_cannot_take_every_connection(serve):
    """gRPC bounds connections only in all: one peer holding 4096 idle connections shut out
    every other client until the handshake timeout closed them (issue 58). Now a peer past
    max_connections_per_peer is reset on arrival, and other peers are served at once."""
    server = serve(limits=Limits(max_connections_per_peer=4))
    held = [_connect_from("127.0.0.2", server.address) for _ in range(4)]
    extra = _connect_from("127.0.0.2", server.address)
    assert _reset_within(extra, 1.0)
    extra.close()
    started = time.monotonic()
    assert raw_call(server.address, request({"response": "abc"})).results[0].reward == 3.0
    assert time.monotonic() - started < 2.0  # not after the handshake timeout (5 s) freed one
    assert health_of(server.address) == health_pb2.HealthCheckResponse.SERVING
    held.pop().close()
    time.sleep(0.2)
    again = _connect_from("127.0.0.2", server.address)  # a place came free
    assert not _reset_within(again, 0.3)
    for sock in [*held, again]:
        sock.close()


def test_a_peer_is_an_ipv4_address_or_an_ipv6_64():
    from ferrule_rewards.front import peer_key

    assert peer_key("10.0.0.7") == "10.0.0.7"
    assert peer_key("::ffff:10.0.0.7") == "10.0.0.7"  # IPv4 on a dual-stack socket
    assert peer_key("2001:db8:1:2::5") == peer_key("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert peer_key("2001:db8:1:3::5") != peer_key("2001:db8:1:2::5")
    assert peer_key("fe80::1%eth0") == "fe80::/64"


@pytest.mark.parametrize("bound", [-1, 4097])
def test_a_per_peer_bound_out_of_range_is_refused(bound):
    with pytest.raises(ValueError, match="max_connections_per_peer is"):
        Limits(max_connections_per_peer=bound)


def test_large_answers_cross_the_front_whole_and_in_order(serve):
    """The front relays bytes: many samples in one call (a multi-megabyte request and answer)
    and calls at once on one connection come back whole and in order."""
    server = serve()
    client = RewardClient(server.address, batch_size=4096, max_in_flight=4)
    samples = [{"response": "x" * (i % 1000)} for i in range(16384)]
    results = client.score(samples)
    assert [r.reward for r in results] == [float(i % 1000) for i in range(16384)]
    client.close()


def test_the_front_relays_on_uvloop_as_on_asyncios_loop(serve, monkeypatch):
    """Under Ray, a reward model's server runs on uvloop, which reads a new connection at once
    whatever `pause_reading` said, and raises on a write to a closed transport: the relay lost
    the bytes a client sent before gRPC's end was joined ("Socket closed": the e2e test of the
    reward model's Ray role). Calls, refusals and health answer on uvloop too."""
    import asyncio

    uvloop = pytest.importorskip("uvloop")
    from ferrule_rewards.client import RewardError

    monkeypatch.setattr(asyncio, "new_event_loop", uvloop.new_event_loop)
    server = serve(token="t" * 32)
    for _ in range(5):  # each a new connection: the race is at every connect
        with RewardClient(server.address, token="t" * 32, retry_for=0) as client:
            assert client.score([{"response": "abcd"}])[0].reward == 4.0
        stranger = RewardClient(server.address, token="x" * 32, retry_for=0)
        with stranger, pytest.raises(RewardError) as refused:
            stranger.score([{"response": "abc"}])
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_descriptor_limit_is_raised_to_the_hard_one(serve):
    """A systemd service gets a soft limit of 1024 descriptors; the server now raises it to
    the hard limit when it starts, and the unit sets LimitNOFILE."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        serve()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    unit = (TESTS.parent / "deploy" / "ferrule-rewards.service").read_text()
    assert "\nLimitNOFILE=" in unit


def test_every_result_fits_the_message_limit_the_late_ones_as_errors():
    """Results were budgeted only when larger than 256 bytes: 4096 small results of
    math_reward (51 bytes each) under --max-message-mb 0.1 failed the whole call with
    RESOURCE_EXHAUSTED. Now the response always fits: the late results that do not are that
    sample's ERROR."""
    from ferrule_rewards.functions import FunctionScorer
    from ferrule_rewards.server import BackgroundServer

    scorer = partial(FunctionScorer.load, "ferrule_rewards.builtin:math_reward")
    limits = Limits(max_batch=2000, max_message_bytes=80_000)
    samples = [{"response": "#### 4", "label": "4"}] * 1999 + [{"label": "4"}]
    with BackgroundServer(scorer, limits=limits) as server:
        reply = raw_call(server.address, request(*samples))
    assert len(reply.results) == 2000 and reply.ByteSize() <= 80_000
    ok = [result.status == pb.SAMPLE_STATUS_OK for result in reply.results]
    first_error = ok.index(False)
    assert first_error > 100 and not any(ok[first_error:])
    assert reply.results[first_error].status == pb.SAMPLE_STATUS_ERROR
    assert "--max-message-mb" in reply.results[-1].error


def test_a_call_counts_until_its_answer_is_sent(serve):
    """A client that never reads its answers (an HTTP/2 window of 1 byte): the call's slot was
    freed before the answer was sent, so answers piled up in memory past --max-concurrency
    (RSS 43 MiB -> 2.8 GiB). Now a call counts until its answer is sent, and one whose answer
    is never taken is cancelled at its deadline."""
    server = serve(limits=Limits(max_concurrency=2))
    big = request(*[{"response": "x"}] * 4000)  # an answer of 44 KB: past a window of 1 byte
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    options.append(("grpc.use_local_subchannel_pool", 1))
    channels = [
        grpc.insecure_channel(server.address, options=[*options, ("ferrule.test", i)])
        for i in range(2)
    ]
    # Streaming calls: gRPC reads a message only when asked, and these are never asked.
    unread = [channel.stream_stream(METHOD)(iter([big]), timeout=3) for channel in channels]
    deadline = time.monotonic() + 2
    while server.server.busy < 2:
        assert time.monotonic() < deadline, server.server.busy
        time.sleep(0.02)
    time.sleep(0.5)  # both are scored by now: only their answers are left to send
    assert status_of(server.address, request({"response": "ab"}))[0] == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    deadline = time.monotonic() + 5
    while server.server.busy:
        assert time.monotonic() < deadline, "the unread calls were not cancelled"
        time.sleep(0.05)
    assert raw_call(server.address, request({"response": "ab"})).results[0].reward == 2.0
    del unread
    for channel in channels:
        channel.close()


def test_a_process_frozen_by_a_kill_that_cannot_list_proc_scores_no_sample_twice(
    serve, tmp_path, monkeypatch
):
    """When a timeout's kill cannot list /proc, the process is frozen rather than killed; its
    journal was then left unread (only a dead writer's was), so the next process scored the
    samples it had finished again. A frozen writer's journal is read too."""
    from ferrule_rewards import tree

    log = tmp_path / "ids"
    monkeypatch.setenv("REWARDS_TEST_LOG", str(log))
    server = serve("once", timeout=1.0)
    real, failures = tree.descendants, []

    def out_of_descriptors(pid):
        if len(failures) < 2:
            failures.append(pid)
            raise OSError(24, "Too many open files", f"/proc/{pid}/task")
        return real(pid)

    monkeypatch.setattr(tree, "descendants", out_of_descriptors)
    responses = [""] * 20
    responses[10] = "gil"
    samples = [{"response": r, "metadata": {"id": str(i)}} for i, r in enumerate(responses)]
    reply = raw_call(server.address, request(*samples), timeout=30)
    statuses = [pb.SampleStatus.Name(r.status)[14:] for r in reply.results]
    assert statuses == ["OK"] * 10 + ["TIMEOUT"] + ["OK"] * 9
    assert failures
    assert sorted(map(int, log.read_text().split())) == list(range(20))  # each once
