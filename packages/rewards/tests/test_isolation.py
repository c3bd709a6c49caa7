"""What a client or a reward function can do to the server, and what it must not: a request
sent slowly, a function that floods its output, forks children or returns huge sub-scores, a
process that dies after finishing samples. Real servers on loopback, real scoring processes."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.client import METHOD
from ferrule_rewards.server import Limits


def request(*samples: dict) -> bytes:
    return pb.ScoreRequest(samples=list(samples)).SerializeToString()


def statuses(reply: pb.ScoreResponse) -> list[str]:
    return [pb.SampleStatus.Name(r.status)[14:] for r in reply.results]


def test_a_slow_sender_holds_no_scoring_process(serve):
    """The body was read while holding a scoring process, with no timeout: a client that
    never finished sending held the only process past the call timeout, and every other call
    failed. Now the body is read first, within the call's deadline."""
    server = serve("length", processes=1, limits=Limits(call_timeout=2.0))
    never = threading.Event()

    def body_that_never_comes():
        never.wait(20)  # the stream is open; the message never arrives
        yield request({"response": "x"})

    with grpc.insecure_channel(server.address) as channel:
        slow = channel.stream_unary(METHOD).future(body_that_never_comes())
        time.sleep(0.3)  # the slow call is admitted and reading
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        started = time.monotonic()
        assert call(request({"response": "abc"}), timeout=1.5).results[0].reward == 3.0
        assert time.monotonic() - started < 1.0
        try:
            slow.result(timeout=5)
            raise AssertionError("the slow call was answered")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert "did not arrive" in error.details()
        finally:
            never.set()
    assert wait_until(lambda: server.server.busy == 0, 2.0)


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_children_of_a_reward_function_die_with_its_process(serve, tmp_path, monkeypatch):
    """A function's children lived on after its process was killed at the timeout, and after
    the server stopped (reparented to init, burning CPU): a fork, a Popen in a new session, a
    daemon's double fork. Now they die with their scoring process, and with the server."""
    log = tmp_path / "pids"
    monkeypatch.setenv("REWARDS_TEST_LOG", str(log))
    server = serve("spawner", timeout=1.0)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        reply = call(request({"response": "fork setsid daemon hang"}), timeout=10)
        assert statuses(reply) == ["TIMEOUT"]
        hung = [int(pid) for pid in log.read_text().split()]
        assert len(hung) == 3
        assert wait_until(lambda: not any(map(running, hung)), 2.0), [*filter(running, hung)]
        # A function that returns leaves its children running, until the server stops.
        log.unlink()
        reply = call(request({"response": "fork setsid daemon"}), timeout=10)
        assert statuses(reply) == ["OK"]
    left = [int(pid) for pid in log.read_text().split()]
    assert len(left) == 3 and all(map(running, left))
    server.stop(grace=0)
    assert wait_until(lambda: not any(map(running, left)), 2.0), [*filter(running, left)]


def test_a_flood_of_output_reaches_the_log_capped(spawn, fn_spec):
    """A function's prints went to the server's stderr without a cap (3.8 GB in 5 s into a log
    file). Now each scoring process's output is capped by --max-log-mb."""
    server = spawn("--function", fn_spec("flood"), "--max-log-mb", "0.25")
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        assert statuses(call(request({"response": "20"}), timeout=30)) == ["OK"]  # 40 MiB
        assert wait_until(lambda: any("the rest is dropped" in line for line in server.log), 5)
    logged = sum(len(line) for line in server.log)
    assert (1 << 18) <= logged < (1 << 18) * 1.5, logged  # the cap, and each line's prefix
    assert server.stop() == 0


def test_a_server_whose_stderr_nobody_reads_keeps_answering(tmp_path, fn_spec):
    """The scoring processes wrote into the server's own stderr: once a pipe there stopped
    being read, a flooding function blocked, was killed at its timeout, and the server froze
    writing that warning (health timed out). Now nothing the server does waits on stderr."""
    address_file = tmp_path / "address"
    server = subprocess.Popen(
        [sys.executable, "-m", "ferrule_rewards", "serve", "--function", fn_spec("flood"),
         "--timeout", "1", "--bind", "127.0.0.1:0", "--address-file", str(address_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ,
    )  # fmt: skip
    try:
        assert wait_until(address_file.exists, 60)
        address = address_file.read_text().strip()
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(3):  # 6 MiB of output each, never read past the pipe's 64 KiB
                flooding = call.future(request({"response": "3"}), timeout=20)
                started = time.monotonic()
                while not flooding.done() or time.monotonic() - started < 1.5:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    time.sleep(0.1)
                assert statuses(flooding.result()) == ["OK"]
            assert statuses(call(request({"response": "0"}), timeout=5)) == ["OK"]
    finally:
        server.kill()
        server.wait()
