"""Attacks on a reward server, and what a well-behaved client sees meanwhile.

    rows, watch = run_all(server_pid, address, token, processes=2)   # a row per attack

Each attack is bounded in time (seconds), returns how many of its calls were answered the way
they should be and how many it made, and leaves nothing running on the client side. `Watch`
meanwhile checks health every 50 ms (1 s deadline), makes a normal Score call every 100 ms (5 s
deadline, retrying a busy refusal within it, as RewardClient does), and samples the memory of
the server and of its scoring processes. A check or call fails when gRPC's deadline passes;
the latencies are figures, measured in this process, which the attacks load too. tests/test_abuse.py asserts on it; benchmarks/rewards_abuse.py
records it.
"""

import functools
import random
import socket
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.client import METHOD
from ferrule_testkit.watch import Watch, answered, cpu_ticks, run_attacks, tree

NORMAL_DEADLINE = 5.0  # a normal call must get its correct answer within this
NORMAL = pb.ScoreRequest(samples=[{"response": "#### 4", "label": "4"}]).SerializeToString()


def _channel(address: str) -> grpc.Channel:
    # Each its own connection, and big enough for the attacks' messages.
    options = [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
    ]
    return grpc.insecure_channel(address, options=options)


def _auth(token: str | None) -> list:
    return [("authorization", f"Bearer {token}")] if token else []


def watch_server(server_pid: int, address: str, token: str | None) -> Watch:
    """Health every 50 ms (1 s deadline, SERVING), a normal Score call every 100 ms (its right
    answer within NORMAL_DEADLINE, retrying a busy refusal within it, as RewardClient does)."""
    health_stub = health_pb2_grpc.HealthStub(_channel(address))
    score = _channel(address).unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)

    def check_health() -> str | None:
        try:
            reply = health_stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        return (
            None
            if reply.status == health_pb2.HealthCheckResponse.SERVING
            else (f"status {reply.status}")
        )

    def normal_call() -> str | None:
        started = time.perf_counter()
        while True:
            left = NORMAL_DEADLINE - (time.perf_counter() - started)
            try:
                result = score(NORMAL, timeout=max(left, 0.01), metadata=_auth(token)).results[0]
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and left > 0.1:
                    time.sleep(0.05)  # busy: retry within the deadline
                    continue
                return f"{error.code().name}: {error.details()}"
            return None if result.reward == 1.1 else f"wrong answer: {result}"

    return Watch(
        server_pid,
        health=check_health,
        normal=normal_call,
        health_every=0.05,
        normal_every=0.1,
        longest_call=NORMAL_DEADLINE,
    )


def _calls(address, bodies, *, token, timeout, expect, workers=32) -> tuple[int, int]:
    """Send `bodies` concurrently; (answered as `expect(reply or error)` says, sent)."""
    with _channel(address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)

        def one(body):
            try:
                return expect(call(body, timeout=timeout, metadata=_auth(token)))
            except grpc.RpcError as error:
                return expect(error)

        return answered(one, bodies, workers)


def _statuses(*names):
    def expect(reply) -> bool:
        if isinstance(reply, grpc.RpcError):
            return reply.code().name in names
        return all(pb.SampleStatus.Name(r.status)[14:] in names for r in reply.results)

    return expect


def _request(*responses: str, **extra) -> bytes:
    return pb.ScoreRequest(
        samples=[{"response": r, "label": "4", **extra} for r in responses]
    ).SerializeToString()


def quadratic_answers(address, token):
    """math_reward's answer extraction on inputs that were quadratic (minutes to hours)."""
    bodies = [
        _request("\n" * (600 << 10)),
        _request(*["\\boxed{" * 2048] * 16),  # 14 KiB each
        _request("answer is a" + " " * (1 << 20) + "b"),
        _request("#### a" + " " * (1 << 20) + "b"),
    ] * 2
    return _calls(address, bodies, token=token, timeout=30, expect=_statuses("OK"))


def gil_hang(address, token):
    """A reward function stuck in C code that holds the GIL, next to normal samples."""
    body = _request("#### 4", "@gil", "#### 4")

    def expect(reply) -> bool:
        if isinstance(reply, grpc.RpcError):
            return False
        statuses = [pb.SampleStatus.Name(r.status)[14:] for r in reply.results]
        return statuses == ["OK", "TIMEOUT", "OK"] and reply.results[0].reward == 1.1

    return _calls(address, [body] * 4, token=token, timeout=30, expect=expect)


def unauthenticated_flood(address, token):
    """16 concurrent 60 MiB calls without a token: each read whole before being refused."""
    body = _request("x" * (60 << 20))
    expect = _statuses("UNAUTHENTICATED")
    return _calls(address, [body] * 16, token=None, timeout=30, expect=expect, workers=16)


def cancel_flood(address, token):
    """150 calls of CPU-bound work with a 30 ms deadline: the work must stop with them."""
    body = _request("@spin")
    expect = _statuses("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "TIMEOUT")
    return _calls(address, [body] * 150, token=token, timeout=0.03, expect=expect)


@functools.cache
def _huge_metadata_request() -> bytes:
    sample = pb.Sample(response="#### 4", label="4")
    for index in range(4_000_000):
        sample.metadata[str(index)] = ""
    return pb.ScoreRequest(samples=[sample]).SerializeToString()


def huge_metadata(address, token):
    """A 60 MiB request carrying a map of millions of entries, which the function reads."""
    expect = _statuses("OK", "TIMEOUT", "RESOURCE_EXHAUSTED")
    return _calls(address, [_huge_metadata_request()], token=token, timeout=20, expect=expect)


# Built before the watch starts: seconds of this process's GIL would delay its own measurements.
huge_metadata.prepare = _huge_metadata_request


def watch_flood(address, token):
    """Health Watch streams need no token: 300 of them, held open for a second."""
    with _channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=2) for _ in range(300)]
        refused = held = 0
        for stream in streams:
            try:
                next(stream)
                held += 1
            except grpc.RpcError as error:
                refused += error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        time.sleep(1.0)
        for stream in streams:
            stream.cancel()
    # Answered as they should: the first 64 served, the rest refused at once.
    return (held == 64) * held + refused, len(streams)


def garbage(address, token):
    """Bytes that are not a ScoreRequest."""
    rng = random.Random(0)
    bodies = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(200)]
    # RESOURCE_EXHAUSTED too: 32 at once and the normal client's call are one over the limit.
    expect = _statuses("INVALID_ARGUMENT", "OK", "INVALID_SAMPLE", "ERROR", "RESOURCE_EXHAUSTED")
    return _calls(address, bodies, token=token, timeout=10, expect=expect)


def slow_senders(address, token):
    """4 calls whose body never comes, with no client deadline: each holds an admission place
    until the server's --call-timeout, and no scoring process (finding 2)."""
    never = threading.Event()

    def body():
        never.wait(60)
        yield NORMAL

    with _channel(address) as channel:
        call = channel.stream_unary(METHOD)
        pending = [call.future(body(), metadata=_auth(token)) for _ in range(4)]
        answered = 0
        for future in pending:
            try:
                future.result(timeout=30)
            except grpc.RpcError as error:
                answered += error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        never.set()
    return answered, len(pending)


def output_flood(address, token):
    """Functions that write 20 MiB to stdout and as much to stderr, twice at once: answered,
    with --max-log-mb of it in the log (finding 3)."""
    return _calls(
        address, [_request("@flood")] * 2, token=token, timeout=30, expect=_statuses("OK")
    )


def forking(address, token):
    """Functions that fork, spawn in a new session and double-fork a daemon, then hang past
    their timeout: the sample times out and none of the children outlives its process
    (finding 4)."""
    answered = sent = 0
    for _ in range(2):
        with tempfile.NamedTemporaryFile("r") as pids:
            ok, one = _calls(
                address,
                [_request("@fork", metadata={"pids": pids.name})],
                token=token,
                timeout=30,
                expect=_statuses("TIMEOUT"),
            )
            children = [int(pid) for pid in Path(pids.name).read_text().split()]
            time.sleep(1.0)
            answered += ok and len(children) == 3 and not any(map(_running, children))
            sent += one
    return answered, sent


def huge_reward(address, token):
    """A batch of 32 whose first reward is 10**400 (no float holds it): that sample gets
    INVALID_REWARD, the 31 others their rewards (finding 1: the whole batch failed, its
    scoring process dying on every retry)."""

    def expect(reply) -> bool:
        if isinstance(reply, grpc.RpcError):
            return False
        statuses = [pb.SampleStatus.Name(r.status)[14:] for r in reply.results]
        return statuses == ["INVALID_REWARD"] + ["OK"] * 31

    body = _request("@huge", *["#### 4"] * 31)
    return _calls(address, [body] * 2, token=token, timeout=30, expect=expect)


def huge_sub_scores(address, token):
    """Samples with 100,000 sub-scores each, next to normal ones: those samples get
    INVALID_REWARD (--max-sub-scores), the others their rewards (finding 5)."""

    def expect(reply) -> bool:
        if isinstance(reply, grpc.RpcError):
            return False
        statuses = [pb.SampleStatus.Name(r.status)[14:] for r in reply.results]
        return statuses == ["INVALID_REWARD"] * 3 + ["OK"] and reply.results[3].reward == 1.1

    body = _request("@subs", "@subs", "@subs", "#### 4")
    return _calls(address, [body] * 2, token=token, timeout=30, expect=expect)


def big_results(address, token):
    """Calls whose 1000 samples return 1000 sub-scores each: 16 MB of results through the
    server, which joins their bytes and decodes none (finding 5)."""

    def expect(reply) -> bool:
        return not isinstance(reply, grpc.RpcError) and all(
            r.status == pb.SAMPLE_STATUS_OK and len(r.sub_scores) == 1000 for r in reply.results
        )

    body = _request(*["@thousand"] * 1000)
    return _calls(address, [body] * 2, token=token, timeout=30, expect=expect)


def crash_after_finished(address, token):
    """Batches whose 16th sample kills its process, after 15 that wrote a side effect: each
    sample runs once, none of them twice (finding 7)."""
    answered = sent = 0
    for _ in range(3):
        with tempfile.NamedTemporaryFile("r") as log:
            samples = [
                {"response": "@crash" if i == 15 else "#### 4", "label": "4",
                 "metadata": {"log": log.name, "id": str(i)}}
                for i in range(40)
            ]  # fmt: skip
            body = pb.ScoreRequest(samples=samples).SerializeToString()
            expected = ["OK"] * 15 + ["ERROR"] + ["OK"] * 24

            def expect(reply, expected=expected) -> bool:
                if isinstance(reply, grpc.RpcError):
                    return False
                return [pb.SampleStatus.Name(r.status)[14:] for r in reply.results] == expected

            ok, one = _calls(address, [body], token=token, timeout=30, expect=expect)
            once = sorted(map(int, Path(log.name).read_text().split())) == list(range(40))
            answered += ok and once
            sent += one
    return answered, sent


def closing_times(sockets: list[socket.socket], within: float) -> list[float]:
    """Seconds until the server closed (or reset) each socket that it closed within `within`
    seconds, without our sending a byte; then every socket is closed."""
    started, closed_at = time.monotonic(), {}
    for sock in sockets:
        sock.setblocking(False)
    while len(closed_at) < len(sockets) and time.monotonic() - started < within:
        for index, sock in enumerate(sockets):
            if index in closed_at:
                continue
            try:
                if sock.recv(64) == b"":
                    closed_at[index] = time.monotonic() - started
            except BlockingIOError:
                pass
            except OSError:
                closed_at[index] = time.monotonic() - started
        time.sleep(0.05)
    for sock in sockets:
        sock.close()
    return list(closed_at.values())


def idle_connections(address, token):
    """300 connections that never send a byte (each holds a descriptor of the server's; 1020
    of them made a kill fail and lost a scoring process for good, issue 58): the server closes
    every one within its handshake timeout (5 s), and keeps answering meanwhile."""
    host, port = address.rsplit(":", 1)
    sockets = [socket.create_connection((host, int(port))) for _ in range(300)]
    return len(closing_times(sockets, 8)), len(sockets)


def one_peer_flood(address, token):
    """1000 silent connections from one stranger (127.0.0.3; Linux answers on all of
    127.0.0.0/8), past the server's default bound per peer (128): the rest are reset on arrival
    (within 1 s), the ones held are closed at the handshake timeout (5 s), and the watch's
    calls from another peer go on meanwhile. gRPC alone bounded connections only in all, so
    one peer could hold every place (issue 58)."""
    host, port = address.rsplit(":", 1)
    sockets = []
    for _ in range(1000):
        sock = socket.socket()
        sock.bind(("127.0.0.3", 0))
        sock.connect((host, int(port)))
        sockets.append(sock)
    closed = closing_times(sockets, 8)
    at_once = sum(seconds < 1.0 for seconds in closed)
    # Answered as they should: each reset at once past the bound, each of the rest closed.
    return min(at_once, len(sockets) - 128) + min(len(closed) - at_once, 128), len(sockets)


def unread_answers(address, token):
    """Calls whose client never reads the answer (an HTTP/2 window of 1 byte): each holds its
    place until its deadline, then ends; answers never pile up in the server's memory (issue
    58: ~50 held, 2.8 GiB)."""
    body = _request(*["#### 4"] * 1000)  # an answer of ~50 KB
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    ends = ("DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED")
    channels = [
        grpc.insecure_channel(address, options=[*options, ("abuse.unread", i)]) for i in range(40)
    ]
    # Streaming calls: gRPC reads a message only when asked, and these are never asked.
    calls = [
        c.stream_stream(METHOD)(iter([body]), timeout=3, metadata=_auth(token)) for c in channels
    ]
    answered = sum(call.code().name in ends for call in calls)
    for channel in channels:
        channel.close()
    return answered, len(calls)


def orphans(address, token):
    """Samples whose function leaves 50 background processes behind: every orphan is reaped,
    none is left a zombie under the server (issue 58: 500 zombies in 0.7 s)."""
    ok, sent = _calls(
        address, [_request(*["@orphans"] * 4)] * 2, token=token, timeout=30,
        expect=_statuses("OK"),
    )  # fmt: skip
    time.sleep(0.5)
    return ok * (not zombies_under(_server_pid[0])), sent


def odd_outputs(address, token):
    """A reward nested 200,000 deep (its message's repr raised RecursionError and the whole
    batch failed) and a function that calls sys.exit (read "killed by SIGKILL"): each fails
    its own sample only."""

    def expect(reply) -> bool:
        if isinstance(reply, grpc.RpcError):
            return False
        statuses = [pb.SampleStatus.Name(r.status)[14:] for r in reply.results]
        return statuses == ["INVALID_REWARD", "OK", "ERROR", "OK"] and (
            reply.results[2].error.startswith("SystemExit: 3")
        )

    body = _request("@deep", "#### 4", "@exit", "#### 4")
    return _calls(address, [body] * 2, token=token, timeout=30, expect=expect)


_server_pid = [0]  # run_all's; for the attacks that look at the server's processes


def zombies_under(pid: int) -> list[int]:
    return [p for p in tree(pid) if _state(p) == "Z"]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


ATTACKS = [
    quadratic_answers,
    gil_hang,
    unauthenticated_flood,
    cancel_flood,
    huge_metadata,
    watch_flood,
    garbage,
    slow_senders,
    output_flood,
    forking,
    huge_reward,
    huge_sub_scores,
    big_results,
    crash_after_finished,
    idle_connections,
    one_peer_flood,
    unread_answers,
    orphans,
    odd_outputs,
]


def idle_within(server_pid: int, processes: int, seconds: float) -> str | None:
    """None when, within `seconds`, the server is down to its `processes` scoring processes
    (each two processes, see below) and none of them uses the CPU (over 0.3 s); otherwise
    what was last seen, for the report:
    how many processes it had and the CPU ticks they used in those 0.3 s."""
    deadline = time.monotonic() + seconds
    seen = "never looked"
    while time.monotonic() < deadline:
        children = tree(server_pid)[1:]
        before = sum(map(cpu_ticks, children))
        time.sleep(0.3)
        after = sum(map(cpu_ticks, tree(server_pid)[1:]))
        # Each scoring process is two: the one that scores and its reaper (child.py).
        if len(children) == 2 * processes and after - before <= 1:
            return None
        seen = f"{len(children)} processes under the server, {after - before} CPU ticks in 0.3 s"
    return seen


def run_all(server_pid: int, address: str, token: str, processes: int) -> tuple[list, Watch]:
    """Every attack in turn, with a Watch throughout: a row of figures per attack, and the
    Watch (stopped) for the whole run's."""
    for attack in ATTACKS:
        getattr(attack, "prepare", lambda: None)()
    watch = watch_server(server_pid, address, token)
    _server_pid[0] = server_pid

    def idle_again(attack, row: dict) -> None:
        # Every call's deadline has passed: nothing may still be working 1.5 s on.
        busy = idle_within(server_pid, processes, 1.5)
        row.update(idle_after=busy is None, busy_after=busy)

    rows = run_attacks(watch, ATTACKS, address, token, after=idle_again, settle=0.5)
    return rows, watch
