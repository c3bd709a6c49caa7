"""The memory estimate against peaks measured on a GPU, at cases it was not fitted to (marked
`gpu`: skipped without one; results in benchmarks/RESULTS.md). A Qwen2.5-1.5B-shaped policy
trains and scores in processes of its own (benchmarks/memory_gpu.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "memory_gpu.py"


@pytest.mark.gpu(count=1)
def test_the_estimate_is_within_15_percent_of_measured_peaks_it_was_not_fitted_to():
    sys.path.insert(0, str(SCRIPT.parent))
    from memory_gpu import CHECKS

    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--cases", ",".join(CHECKS)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    cases = [line for line in lines if "case" in line]
    print(json.dumps(cases))
    assert [c["case"] for c in cases] == CHECKS
    for case in cases:
        assert "estimate_gib" in case, case  # measured, not failed
        assert abs(case["error"]) <= 0.15, case
