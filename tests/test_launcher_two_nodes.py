"""A two-node Ray cluster on this machine (head and worker started by the test with `ray start
--block`), and a short run whose policy and rollout engine are pinned to different nodes."""

import json
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

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_nodes(tmp_path):
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    port = free_port()
    temp = Path(f"/tmp/rf{os.getpid()}")  # Ray's socket paths must stay short
    # Ray 2.60 clusters started by `ray start` require a token from every driver and node.
    env = {
        **os.environ,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    common = ["--block", "--num-cpus=1", "--disable-usage-stats"]
    head = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=false",
            f"--temp-dir={temp}",
            '--resources={"head_node": 1}',
            *common,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(8)
    worker = subprocess.Popen(
        [
            ray,
            "start",
            f"--address=127.0.0.1:{port}",
            "--node-ip-address=127.0.0.1",
            '--resources={"worker_node": 1}',
            *common,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(8)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        for process in (worker, head):  # --block: SIGTERM stops the node's processes too
            process.send_signal(signal.SIGTERM)
        for process in (worker, head):
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def test_roles_on_different_nodes(tmp_path, two_nodes):
    address, env = two_nodes
    out = tmp_path / "two"
    overrides = [
        "loop.steps=3",
        "loop.eval_every=0",
        "output.progress=false",
        f'output.dir="{out}"',
        f'ray.address="{address}"',
        'ray.placement="separate"',
        "ray.cpus_per_role=0.5",
        'ray.roles_on_nodes={policy = "head_node", rollout = "worker_node"}',
    ]
    args = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for item in overrides:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=420, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    roles = json.loads((out / "roles.json").read_text())
    assert roles["policy-0"]["node_id"] != roles["rollout-0"]["node_id"]
    assert len(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])) > 3
