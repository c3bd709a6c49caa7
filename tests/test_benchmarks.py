"""The benchmark scripts' own argument checks (their timings run on GPUs and by hand)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dpo_tiny_refuses_a_single_round_before_loading_the_model():
    """One round is all warm-up: the script used to crash on the median of no timings."""
    done = run_script("dpo_tiny.py", "--rounds", "1")
    assert done.returncode == 2
    assert "--rounds must be at least 2 (the first warms up), got 1" in done.stderr


def test_step_gpu_scaling_needs_more_than_one_gpu():
    done = run_script("step_gpu.py", "--scaling")
    assert done.returncode == 2
    assert "--scaling compares --gpus N >= 2 with one GPU, got --gpus 1" in done.stderr


def test_nccl_ray_refuses_more_gpus_than_the_machine_has():
    done = run_script("nccl_ray.py", "--gpus", "64")
    assert done.returncode == 2
    assert "--gpus 64: needs 2 or more CUDA GPUs, at most this machine's" in done.stderr


def test_sequence_parallel_gpu_refuses_one_step():
    done = run_script("sequence_parallel_gpu.py", "--steps", "1")
    assert done.returncode == 2
    assert "--steps must be >= 2" in done.stderr


@pytest.mark.e2e  # two DeepSpeed groups of 2 processes
def test_sequence_parallel_gpu_runs_its_cases_on_cpu_with_the_tiny_model(tmp_path):
    """The GPU script's whole path (both cases, their processes, the summary) on gloo, so that
    a GPU session spends its time on the measurement."""
    done = run_script(
        "sequence_parallel_gpu.py", "--model", "tiny", "--lengths", "64", "--steps", "2",
        "--no-checkpointing", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(c["length"], c["sequence_parallel"]) for c in lines[:2]] == [(64, 1), (64, 2)]
    assert all(c["step_s"] > 0 and c["tokens_per_s_per_gpu"] > 0 for c in lines[:2])
    assert lines[-1] == {
        "name": "sequence_parallel_gpu",
        "model": "tiny",
        "checkpointing": False,
        "longest_whole": 64,
        "longest_shared": 64,
        "ratio": 1.0,
    }
