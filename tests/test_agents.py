"""Multi-turn agent RL through the real `rlhf-launch`: episodes of an environment on the vLLM
engine (examples/agent-retry.toml: reverse a word, another try after a miss), GRPO on the
transcripts with the environment's tokens masked, and episodes that fail without failing the run.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "agent-retry.toml"


def command(out: Path, *overrides: str) -> list[str]:
    args = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for item in ["output.progress=false", "output.checkpoint_every=0", f'output.dir="{out}"']:
        args += ["--set", item]
    for item in overrides:
        args += ["--set", item]
    return args


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.soak  # a learning curve
def test_the_agent_example_learns_its_multi_turn_task(tmp_path):
    out = tmp_path / "agent"
    done = subprocess.run(
        command(out, "loop.eval_every=0"),  # the example's 40 steps
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = records(out)
    print(
        f"agent: greedy success {summary['accuracy_before']:.2f} -> {summary['accuracy_after']:.2f}"
        f"; turns {steps[0]['episodes/turns']:.2f} -> {steps[-1]['episodes/turns']:.2f}"
    )
    # Episodes of one or two answers, a second answer only after a miss
    assert all(1.0 <= r["episodes/turns"] <= 2.0 for r in steps)
    assert max(r["episodes/turns"] for r in steps) > 1.0
    assert all(r["episodes/failed"] == 0 for r in steps)
    # greedy episodes' success (an exact first answer): 0.33 -> 0.47 on the development machine
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.05
    assert summary["eval_after"]["reward"] > summary["eval_before"]["reward"] + 0.05


@pytest.mark.e2e
def test_failed_episodes_are_counted_and_too_many_stop_the_run(tmp_path):
    broken = f"{ROOT / 'tests' / 'flaky_environment.py'}:SometimesBroken"
    out = tmp_path / "flaky"
    done = subprocess.run(
        command(
            out,
            f'environment.name="{broken}"',
            "environment.step_timeout=2",
            "environment.max_failed_fraction=0.3",
            "loop.steps=2",
            "loop.eval_every=0",
            'rollout.backend="transformers"',  # about the episodes, not the engine: starts sooner
            # per-token rewards: the first answer's partial credit at its own turn
            'trainer.estimator="reinforce_plus_plus"',
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for r in records(out):  # hung ones timed out, raising ones failed; the steps went on
        assert r["episodes/failed_env_timeout"] > 0 and r["episodes/failed_env_error"] > 0
        assert (
            r["episodes/failed"]
            == r["episodes/failed_env_timeout"] + r["episodes/failed_env_error"]
        )
    stopped = subprocess.run(
        command(
            tmp_path / "stopped",
            f'environment.name="{broken}"',
            "environment.step_timeout=2",
            "environment.max_failed_fraction=0.01",
            "loop.steps=2",
            'rollout.backend="transformers"',
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode != 0
    assert "step 1: environment" in stopped.stderr and "SometimesBroken" in stopped.stderr
    assert "env_error" in stopped.stderr and "env_timeout" in stopped.stderr
