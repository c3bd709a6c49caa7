"""`rlhf-rewards serve --workers N` as subprocesses: the port shared by worker processes, draining,
a killed worker replaced, a killed supervisor taking its workers along, and errors."""

import os
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from ferrule_rewards.client import RewardClient

# With 32 connections the chance that the kernel puts all of them on one of two workers is 2^-31.
CONNECTIONS = 32


def worker_pids(server) -> list[int]:
    """The worker pids that the `serving` line names."""
    line = next(line for line in server.log if " serving " in line)
    return [int(pid) for pid in re.search(r"pids ([\d, ]+)", line)[1].split(", ")]


def answered_by(address: str, n: int = 64, response: str = "") -> set[int]:
    """The pids of the server processes whose scoring processes scored n samples, sent as
    n / 2 concurrent calls."""
    with RewardClient(
        address, batch_size=2, max_in_flight=n // 2, connections_per_address=CONNECTIONS
    ) as client:
        results = client.score([{"response": response}] * n)
    assert all(result.reward == 1.0 for result in results)
    return {int(result.sub_scores["server"]) for result in results}


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"PPid:\s+(\d+)", status)[1])


def gone(pid: int, within: float = 10) -> bool:
    """Whether process `pid` ends (or is a zombie) within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_workers_share_the_port_and_both_answer(spawn, fn_spec):
    server = spawn("--function", fn_spec("pid"), "--workers", "2")
    pids = worker_pids(server)
    assert len(pids) == 2 and server.process.pid not in pids
    assert all(parent_of(pid) == server.process.pid for pid in pids)
    assert answered_by(server.address) == set(pids)
    assert server.stop() == 0


@pytest.mark.e2e  # ~5-10 s of subprocesses (the fast tier stays under 10 minutes)
def test_sigterm_drains_every_worker(spawn, fn_spec, tmp_path):
    started = tmp_path / "started"  # a line per sample a worker started scoring
    server = spawn(
        "--function", fn_spec("pid"), "--workers", "2", "--processes", "4", "--grace", "10",
        env={"REWARDS_TEST_LOG": str(started)},
    )  # fmt: skip
    pids = worker_pids(server)
    outcome = {}

    def in_flight():  # 8 one-sample calls of 2 s each, all at once, spread over the workers
        with RewardClient(
            server.address, batch_size=1, max_in_flight=8, connections_per_address=CONNECTIONS
        ) as client:
            outcome["results"] = client.score([{"response": "2"}] * 8)

    caller = threading.Thread(target=in_flight)
    caller.start()
    deadline = time.monotonic() + 30  # SIGTERM only once every call is being scored
    while not started.exists() or len(started.read_text().split()) < 8:
        assert time.monotonic() < deadline, "the 8 calls did not all start"
        time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    assert server.refusal() == grpc.StatusCode.UNAVAILABLE  # new calls are refused
    caller.join()
    results = outcome["results"]  # every call in flight finished, on both workers
    assert all(result.ok and result.reward == 1.0 for result in results)
    assert {int(result.sub_scores["server"]) for result in results} == set(pids)
    assert server.wait(10) == 0
    assert all(gone(pid, within=0) for pid in pids)
    log = "".join(server.log)
    assert log.count("draining: ") == 2 and log.count("stopped") == 2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_every_process_at_once_drains_too(spawn, fn_spec, signum):
    """As systemd stops a service (it signals the whole control group), and as a closed
    terminal hangs up its process group: SIGHUP killed every process (exit 129)."""
    server = spawn("--function", fn_spec("pid"), "--workers", "2")
    pids = worker_pids(server)
    for pid in [server.process.pid, *pids]:
        os.kill(pid, signum)
    assert server.wait(10) == 0
    assert all(gone(pid, within=0) for pid in pids)
    assert "".join(server.log).count("draining: ") == 2


def test_a_killed_worker_is_replaced_and_no_sample_is_lost(spawn, fn_spec):
    server = spawn("--function", fn_spec("pid"), "--workers", "2")
    killed, survivor = worker_pids(server)
    results, stop = [], threading.Event()

    def load():  # keeps scoring through the kill
        with RewardClient(server.address, batch_size=4, connections_per_address=8) as client:
            while not stop.is_set():
                results.extend(client.score([{"response": "0.002"}] * 32))

    loader = threading.Thread(target=load)
    loader.start()
    time.sleep(0.5)
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not any(" serves again " in line for line in server.log):
        assert time.monotonic() < deadline and server.process.poll() is None, server.log
        time.sleep(0.05)
    time.sleep(0.3)
    stop.set()
    loader.join(30)
    assert results and all(result.ok and result.reward == 1.0 for result in results)
    log = "".join(server.log)
    assert f"worker 0 (pid {killed}): was killed by SIGKILL; starting another" in log
    replacement = int(re.search(r"worker 0 serves again \(pid (\d+)\)", log)[1])
    assert parent_of(replacement) == server.process.pid
    assert answered_by(server.address) == {survivor, replacement}
    assert server.stop() == 0


def test_a_worker_that_keeps_dying_stops_the_server(spawn, fn_spec):
    server = spawn("--function", fn_spec("pid"), "--workers", "2")
    pid = worker_pids(server)[1]
    for deaths in (1, 2):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (
            len(again := re.findall(r"worker 1 serves again \(pid (\d+)\)", "".join(server.log)))
            < deaths
        ):
            assert time.monotonic() < deadline, server.log
            time.sleep(0.05)
        pid = int(again[-1])
    os.kill(pid, signal.SIGKILL)  # the third death within a minute
    assert server.wait(30) == 1
    assert "error: worker 1 died 3 times within 60s" in "".join(server.log)


def test_workers_leave_with_a_killed_supervisor(spawn, fn_spec):
    server = spawn("--function", fn_spec("pid"), "--workers", "2")
    pids = worker_pids(server)
    server.process.kill()
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_a_bad_worker_count_exits_2(spawn, workers):
    server = spawn("--function", "nowhere:f", "--workers", workers, ready=False)
    assert server.process.returncode == 2
    assert f"argument --workers: {workers} is out of range: must be >= 1" in "".join(server.log)


@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (["--function", "nowhere:f"], "cannot import 'nowhere'", 2),
        (["--function", "ferrule_rewards.builtin:exact_match", "--bind", "0.0.0.0:0"],
         "refusing to listen on 0.0.0.0:0", 2),
        (["--function", "ferrule_rewards.builtin:exact_match", "--bind", "unix:/tmp/x.sock"],
         "needs a host:port to share", 2),
    ],
)  # fmt: skip
def test_startup_errors_are_reported_before_serving(spawn, args, message, status):
    server = spawn(*args, "--workers", "2", env={"FERRULE_REWARDS_TOKEN": ""}, ready=False)
    log = "".join(server.log)
    assert server.process.returncode == status and message in log, log
    assert " serving " not in log


def test_a_worker_whose_function_fails_to_import_exits_2_with_one_line(spawn, tmp_path):
    """With workers too, a reward module that raises on import is the one-line error (exit 2)
    that names the file and line, not a worker's traceback."""
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('broken on purpose')\n")
    server = spawn("--function", f"{broken}:f", "--workers", "2", ready=False)
    log = "".join(server.log)
    assert server.process.returncode == 2, log
    assert f"{broken}:1: RuntimeError: broken on purpose" in log and " serving " not in log
    assert "Traceback" not in log


@pytest.mark.parametrize(("first", "second"), [("1", "2"), ("2", "1"), ("2", "2")])
def test_a_taken_port_is_an_error_with_workers_too(spawn, first, second):
    function = ["--function", "ferrule_rewards.builtin:exact_match"]
    taken = spawn(*function, "--workers", first)
    late = spawn(*function, "--workers", second, "--bind", taken.address, ready=False)
    assert late.process.returncode == 2
    assert f"cannot listen on {taken.address}" in "".join(late.log)
