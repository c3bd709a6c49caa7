"""DeepSpeed on CPU: two processes train a kit model with ZeRO-3 over gloo."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ferrule_testkit import tiny_model

WORKER = Path(__file__).with_name("deepspeed_step_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e  # two DeepSpeed processes, ~10 s on 2 cores
def test_zero3_two_processes_train(tmp_path):
    model = tiny_model("qwen2")
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(model), str(tmp_path / f"{rank}.json")],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, output[-3000:]
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]

    for r in results:
        assert r["losses"][-1] < r["losses"][0], r["losses"]  # each rank's own batch is learned
        assert r["shard_numel"] * 2 >= r["full_numel"] > r["shard_numel"]  # ZeRO-3 really shards
    # both ranks gathered the same full weights after the same optimizer steps
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-12)
