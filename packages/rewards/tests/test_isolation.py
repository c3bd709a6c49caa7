"""What a client or a reward function can do to the server, and what it must not: a request
sent slowly, a function that floods its output, forks children or returns huge sub-scores, a
process that dies after finishing samples. Real servers on loopback, real scoring processes."""

import threading
import time
from pathlib import Path

import grpc

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
