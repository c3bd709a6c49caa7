"""The benchmark scripts' own argument checks (their timings run on GPUs and by hand)."""

import subprocess
import sys
from pathlib import Path

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
