"""examples/weightsync/ runs as written: a sender and two receivers as separate processes, on
CPU over gloo broadcast and shared memory; every version's digest matches on both sides and
every process ends cleanly once the sender closes."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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
