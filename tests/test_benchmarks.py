"""The benchmark scripts' own argument checks (their timings run on GPUs and by hand)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dpo_tiny_refuses_a_single_round_before_loading_the_model():
    """One round is all warm-up: the script used to crash on the median of no timings."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "dpo_tiny.py"), "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--rounds must be at least 2 (the first warms up), got 1" in done.stderr


def test_step_gpu_scaling_needs_more_than_one_gpu():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_gpu.py"), "--scaling"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--scaling compares --gpus N >= 2 with one GPU, got --gpus 1" in done.stderr
