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
import pytest
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


@pytest.mark.e2e  # ~8 s: a server process of its own
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
        # And it stops on SIGTERM: exiting waited forever to flush the log into that pipe.
        server.terminate()
        assert server.wait(15) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_sub_scores_past_the_limit_fail_their_sample_only(serve):
    """A sample may return at most --max-sub-scores sub-scores; past it, that sample's
    INVALID_REWARD. And a response that would pass the message limit failed the whole call
    with RESOURCE_EXHAUSTED ("Sent message larger than max"): now each sample whose result
    does not fit gets an error of its own."""
    server = serve("sub_scores", limits=Limits(max_sub_scores=50_000, max_message_bytes=1 << 20))
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        reply = call(request(*[{"response": r} for r in ("3", "50001", "2")]), timeout=20)
        assert statuses(reply) == ["OK", "INVALID_REWARD", "OK"]
        assert len(reply.results[0].sub_scores) == 3 and reply.results[0].sub_scores["s2"] == 2
        assert "50001 sub-scores" in reply.results[1].error
        assert "--max-sub-scores" in reply.results[1].error
        # 40000 sub-scores are ~0.6 MiB: one fits in 1 MiB, the second would not.
        big = [{"response": r} for r in ("1", "40000", "40000", "1", "40000", "1")]
        reply = call(request(*big), timeout=20)
        assert statuses(reply) == ["OK", "OK", "ERROR", "OK", "ERROR", "OK"]
        assert len(reply.results[1].sub_scores) == 40000
        assert "message limit" in reply.results[2].error
        assert reply.ByteSize() <= 1 << 20


def test_a_finished_sample_is_never_scored_twice(serve, tmp_path, monkeypatch):
    """Results finished in the last 50 ms before a process died (a crash, or a hang that holds
    the GIL, which stopped the thread that sent them ahead) were lost and scored again by the
    next process: a function with side effects saw those samples twice. Now each result is in
    memory the server reads before the next sample starts."""
    log = tmp_path / "ids"
    monkeypatch.setenv("REWARDS_TEST_LOG", str(log))
    server = serve("once", timeout=1.0)
    responses = [""] * 40
    responses[15], responses[30] = "crash", "gil"
    samples = [{"response": r, "metadata": {"id": str(i)}} for i, r in enumerate(responses)]
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        reply = call(request(*samples), timeout=20)
    expected = ["OK"] * 40
    expected[15], expected[30] = "ERROR", "TIMEOUT"
    assert statuses(reply) == expected
    assert all(reply.results[i].reward == 2 * i for i in range(40) if expected[i] == "OK")
    assert "SIGKILL" in reply.results[15].error
    assert sorted(map(int, log.read_text().split())) == list(range(40))  # each once


def test_orphans_a_reward_function_leaves_are_reaped(serve):
    """A scoring process adopts the orphans of its subtree (a child subreaper) but never
    reaped them: 500 samples of `sh -c "sleep 0.01 &"` left 500 zombies. Now they are reaped,
    and a function's own children are still its own to wait for (subprocess.run's check)."""
    from ferrule_rewards.tree import descendants

    server = serve("orphaner", processes=1)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        reply = call(request(*[{"response": ""}] * 60), timeout=30)
    assert statuses(reply) == ["OK"] * 60

    def zombies() -> list[int]:
        return [pid for pid in descendants(os.getpid()) if _state(pid) == "Z"]

    assert wait_until(lambda: not zombies(), 2.0), len(zombies())


def test_listing_a_tree_while_its_processes_exit_never_raises():
    """A process can exit between being listed as a child and its /proc entry being read:
    `descendants` raised FileNotFoundError or ProcessLookupError (~0.7% of calls on a tree that
    forks and reaps in a loop; it failed CI in the orphans test above, and a kill at a deadline
    would have raised with it). Now a process that is gone has no children."""
    from ferrule_rewards.tree import descendants

    churn = subprocess.Popen(["sh", "-c", "while :; do /bin/true & /bin/true & wait; done"])
    try:
        deadline, calls = time.monotonic() + 2.0, 0
        while time.monotonic() < deadline:
            assert all(isinstance(pid, int) for pid in descendants(churn.pid))
            calls += 1
        assert calls > 1000  # enough tries to meet the race (old code: ~7 errors a 1000)
    finally:
        churn.kill()
        churn.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_result_that_cannot_be_checked_fails_its_sample_only(serve):
    """A per-batch function returning one value nested 200,000 deep: checking it formatted it
    with `!r`, the RecursionError escaped, and all 8 samples of the batch were ERROR ("killed
    by SIGKILL"). Now any exception while checking one output fails that sample only, and the
    repr in the message is bounded."""
    server = serve("batch_bad_outputs", processes=1)
    responses = ["deep", "ok", "float", "ok", "subs", "ok", "ok", "ok"]
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        reply = call(request(*[{"response": r} for r in responses]), timeout=30)
    assert statuses(reply) == ["INVALID_REWARD", "OK", "ERROR", "OK", "ERROR", "OK", "OK", "OK"]
    assert len(reply.results[0].error) < 300 and "[[[" in reply.results[0].error
    assert "no float today" in reply.results[2].error
    assert "no float today" in reply.results[4].error


def test_scoring_processes_import_nothing_from_the_working_directory(tmp_path, monkeypatch):
    """Scoring processes started as `python -m ...`, which puts the working directory first on
    sys.path: a `mmap.py` where the server started ran in every scoring process. Now they
    start with -P; the reward module itself is still looked up there (README), and what is
    imported after it finds the standard library first."""
    from functools import partial

    from ferrule_rewards.functions import FunctionScorer
    from ferrule_rewards.server import BackgroundServer

    ran = tmp_path / "ran"
    for name in ("mmap", "json"):
        (tmp_path / f"{name}.py").write_text(
            f"open({str(ran)!r}, 'a').write({name!r} + '\\n')\nraise ImportError('shadowed')\n"
        )
    (tmp_path / "cwd_rewards.py").write_text(
        "def reward(response):\n    import json\n    return float(len(json.dumps(response)))\n"
    )
    monkeypatch.chdir(tmp_path)
    scorer = partial(FunctionScorer.load, "cwd_rewards:reward", timeout=5.0)
    with BackgroundServer(scorer) as server, grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        reply = call(request({"response": "abc"}), timeout=10)
    assert statuses(reply) == ["OK"] and reply.results[0].reward == 5.0
    assert not ran.exists(), ran.read_text()


def test_a_function_that_exits_is_reported_as_such(serve):
    """A function that called sys.exit was reported "killed by SIGKILL" (its process exited,
    and the server killed it before asking how). Now sys.exit is that sample's error, and a
    process that exits by itself (os._exit) is reported with its status."""
    server = serve("exits", processes=1)
    samples = [{"response": r} for r in ("ok", "sys.exit", "ok", "os._exit", "ok")]
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        reply = call(request(*samples), timeout=30)
    assert statuses(reply) == ["OK", "ERROR", "OK", "ERROR", "OK"]
    assert reply.results[1].error.startswith("SystemExit: 3"), reply.results[1].error
    assert "exited with status 3" in reply.results[3].error, reply.results[3].error
