"""The GSM8K-style example (examples/gsm8k-tiny.toml) as a smoke run, shortened: two sources in
two formats, an SFT warm start from a file, evaluation through the reward server with pass@k
per source, sample tables, Weights & Biases offline (real Ray, vLLM, DeepSpeed on CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).parents[1] / "examples" / "gsm8k-tiny.toml"
REWARD = Path(__file__).parent / "metadata_reward.py"


def test_gsm8k_style_smoke_run_reports_pass_at_k_per_source(tmp_path):
    out = tmp_path / "gsm8k"
    overrides = [
        "loop.steps=4",
        "loop.eval_every=2",
        "sft.steps=20",
        "task.eval_prompts=8",
        "output.checkpoint_every=2",
        "output.progress=false",
        "output.wandb=true",
        f'output.dir="{out}"',
        f'rewards.function="{REWARD}:checked_number_match"',
    ]
    args = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for item in overrides:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "one_step: 300 training / 8 held-out prompts, weight 2" in result.stdout
    assert "held-out after RL:  reward" in result.stdout

    summary = json.loads((out / "summary.json").read_text())
    for report in (summary["eval_before"], summary["eval_after"]):
        for source in ("", "one_step/", "two_step/"):
            for key in ("reward", "pass@1", "pass@4"):
                assert 0 <= report[f"{source}{key}"] <= 1, (source, key, report)
        assert report["pass@1"] <= report["pass@4"]
        assert report["reward_failed"] == 0  # every sample had its label and metadata
        assert "accuracy" not in report  # exact match is the synthetic tasks' figure
    assert summary["data"]["two_step"] == {
        "train": 300,
        "held_out": 8,
        "dropped_too_long": {"train": 0, "held_out": 0},
    }
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["reward/failed"] == 0 for r in records)
    # 16 prompts a step, 2:1 between 300 and 300 rows: about 4 * 16 * 2/3 / 300 passes of one_step
    assert 0.1 < records[-1]["data/epoch/one_step"] < 0.2
    assert 0.03 < records[-1]["data/epoch/two_step"] < 0.11
    assert "eval/one_step/pass@4" in records[1] and "eval/two_step/reward" in records[3]
    assert (out / "sft" / "model" / "config.json").exists()  # the warm start from sft.jsonl

    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [0, 2, 4]
    assert {s["source"] for s in samples} <= {"one_step", "two_step"}
    assert all(s["prompt"].startswith("Question: ") and s["label"].isdigit() for s in samples)
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    data = next(wandb_run.glob("run-*.wandb")).read_bytes()
    assert b"eval/one_step/pass@4" in data and b"eval/samples" in data
