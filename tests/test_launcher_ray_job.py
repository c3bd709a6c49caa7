"""The documented `ray job submit` use: a head node with its job server, started by the test,
and `rlhf-launch` submitted to it as a Ray job that joins the cluster (`ray.address="auto"`)."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.serial]
ROOT = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_submitted_as_a_ray_job():
    bin_dir = Path(sys.executable).parent
    temp = Path(f"/tmp/rj{os.getpid()}")  # Ray's socket paths must stay short
    dashboard = free_port()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",  # the job finds rlhf-launch
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    ray = str(bin_dir / "ray")
    head = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            "--block",
            f"--port={free_port()}",
            f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=2",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        submit = [
            ray,
            "job",
            "submit",
            "--address",
            f"http://127.0.0.1:{dashboard}",
            "--working-dir",
            ".",
            "--",
            "rlhf-launch",
            "examples/tiny.toml",
            "--set",
            "loop.steps=2",
            "--set",
            "ray.address='auto'",
            "--set",
            "output.progress=false",
        ]
        # The head's job agent comes up some seconds after the dashboard, later on a loaded
        # machine ("No available agent to submit job, please try again later"): try again.
        time.sleep(15)
        deadline = time.monotonic() + 180
        while True:
            result = subprocess.run(
                submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420
            )
            said = result.stdout + result.stderr
            not_up = any(s in said for s in ("No available agent", "onnection refused"))
            if result.returncode == 0 or not not_up or time.monotonic() > deadline:
                break
            time.sleep(5)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert "summary: accuracy_before" in result.stdout
    finally:
        head.send_signal(signal.SIGTERM)  # --block: stops the node's processes too
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
