"""One run per output directory (issue 18): a second launcher on a directory in use is refused
at once, naming the holder; the kernel frees the lock when the holder dies, even by kill -9."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrule_launcher.calls import RunError
from ferrule_launcher.run_lock import hold

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny.toml"
HOLDER = """
import sys, time
from pathlib import Path
from ferrule_launcher.run_lock import hold
with hold(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A process that holds tmp_path/out's lock, as a running launcher does."""
    out = tmp_path / "out"
    out.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    yield out, process
    process.kill()
    process.wait()


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(holder):
    out, process = holder
    with pytest.raises(RunError) as error, hold(out):
        pytest.fail("took a lock that another process holds")
    message = str(error.value)
    assert f"[output] dir {out} is in use by another run" in message
    assert f"pid {process.pid} on host {socket.gethostname()}" in message


def test_kill_9_of_the_holder_frees_the_directory_at_once(holder):
    out, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    with hold(out):  # no waiting, no stale-lock cleanup
        # the holder's record, not its text: a pid's digits may appear in the timestamp
        assert json.loads((out / ".run.lock").read_text())["pid"] != process.pid


def test_the_lock_is_released_when_the_run_ends(tmp_path):
    for _ in range(2):  # one process, two runs after each other
        with hold(tmp_path):
            pass


def test_rlhf_launch_on_a_directory_in_use_exits_at_once(holder):
    out, process = holder
    started = time.monotonic()
    result = subprocess.run(
        [shutil.which("rlhf-launch"), str(EXAMPLE), "--resume", "--set", f'output.dir="{out}"'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert f"rlhf-launch: error: [output] dir {out} is in use by another run" in result.stderr
    assert f"pid {process.pid}" in result.stderr
    assert "ray:" not in result.stdout and "resuming" not in result.stdout  # nothing started
    assert time.monotonic() - started < 60
