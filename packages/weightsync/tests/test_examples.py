"""examples/weightsync/ runs as written: a sender and two receivers as separate processes, on
CPU over gloo broadcast and shared memory; every version's digest matches on both sides and
every process ends cleanly once the sender closes."""

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# the examples as real processes: 3-9 s a test
pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "weightsync"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_the_example_sender_and_receivers_run_as_written(transport):
    common = ["--transport", transport, "--port", str(free_port()), "--receivers", "2"]
    processes = [_run("sender.py", *common, "--steps", "3")]
    processes += [_run("receiver.py", *common, "--rank", str(rank)) for rank in (1, 2)]
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err
            assert "Traceback" not in err and "leaked" not in err, err
            outputs.append(out)
    finally:
        for process in processes:
            process.kill()
    sent = dict(re.findall(r"sent version (\d+) \(step \d\): (\w+)", outputs[0]))
    assert list(sent) == ["1", "2", "3"] and outputs[0].endswith("closed\n"), outputs[0]
    for rank, out in zip((1, 2), outputs[1:], strict=True):
        assert dict(re.findall(rf"rank {rank} loaded version (\d+): (\w+)", out)) == sent, out
        assert out.endswith(f"rank {rank}: the sender closed the stream\n"), out


def test_the_examples_started_with_different_receiver_counts_both_fail_at_once_in_one_line():
    # The receiver died with a traceback; the sender waited 900 s, its error not saying why.
    common = ["--port", str(free_port())]
    sender = _run("sender.py", *common, "--receivers", "2")
    receiver = _run("receiver.py", *common, "--receivers", "1", "--rank", "1")
    try:
        _, sender_err = sender.communicate(timeout=60)
        _, receiver_err = receiver.communicate(timeout=60)
    finally:
        sender.kill()
        receiver.kill()
    assert sender.returncode == 1 and receiver.returncode == 1, sender_err + receiver_err
    assert re.fullmatch(
        r"receiver rank 1 was started for 1 receivers, .* expects 2: .*\n", sender_err
    )
    assert re.fullmatch(r"receiver rank 1 expects 1 receivers, .* created for 2\n", receiver_err)


HELD = """
import sys, time
sys.path.insert(0, {examples!r})
from sender import make_model
from ferrule_weightsync import create_sender
sender = create_sender("broadcast", "127.0.0.1", {port}, 1)
sender.send(make_model(seed=0, device="cpu").named_parameters())
time.sleep(60)  # training; the test ends this process
"""


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_example_receiver_ends_cleanly_when_its_sender_is_terminated_or_killed(how):
    # The receiver died with torch's C++ stack, a Python traceback and "WeightSyncError: rank 1:
    # lost the weight-sync group ... Failed to recv, got 0 bytes".
    port = free_port()
    sender = subprocess.Popen(
        [sys.executable, "-c", HELD.format(examples=str(EXAMPLES), port=port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    receiver = _run("receiver.py", "--port", str(port), "--receivers", "1", "--rank", "1")
    try:
        assert receiver.stdout.readline().startswith("rank 1 loaded version 1: ")
        sender.send_signal(how)
        out, err = receiver.communicate(timeout=60)
    finally:
        sender.kill()
        receiver.kill()
    if how == signal.SIGTERM:  # the sender closed the stream on its way out
        assert (receiver.returncode, out, err) == (0, "rank 1: the sender closed the stream\n", "")
    else:  # one line, no stack
        assert receiver.returncode == 1 and out == "", err
        assert re.fullmatch(r"rank 1: the sender went away \(killed, .*\n", err), err
