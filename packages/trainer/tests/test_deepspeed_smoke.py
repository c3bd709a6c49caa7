"""DeepSpeed on CPU: two processes train a kit model with ZeRO-3 over gloo."""

import json
import sys
from pathlib import Path

import pytest

from ferrule_testkit import tiny_model
from ferrule_testkit.gloo import run_ranks

WORKER = Path(__file__).with_name("deepspeed_step_worker.py")


@pytest.mark.e2e  # two DeepSpeed processes, ~10 s on 2 cores
def test_zero3_two_processes_train(tmp_path):
    model = tiny_model("qwen2")
    run_ranks([sys.executable, str(WORKER), str(model), str(tmp_path)], 2, timeout=400)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]

    for r in results:
        assert r["losses"][-1] < r["losses"][0], r["losses"]  # each rank's own batch is learned
        assert r["shard_numel"] * 2 >= r["full_numel"] > r["shard_numel"]  # ZeRO-3 really shards
    # both ranks gathered the same full weights after the same optimizer steps
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-12)
