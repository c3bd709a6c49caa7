"""Classic RLHF on CPU, end to end: a reward model trained by `rlhf-train rm` on preference pairs,
then PPO in `rlhf-launch` against it, the reward model served by ferrule-rewards (normalised by
its saved moments) and the critic started from it. The task's exact-match accuracy is never
shown to PPO: it rises only if the reward model learned the preference and PPO followed it.
(The policy is examples/tiny/model, itself the result of a short SFT on the task.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ferrule_testkit import reversal_pairs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]
WARM = ROOT / "examples" / "tiny" / "model"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_then_reward_model_then_ppo_against_it(tmp_path):
    train = write(tmp_path / "pairs.jsonl", reversal_pairs(1024, seed=1))
    test = write(tmp_path / "pairs_test.jsonl", reversal_pairs(100, seed=2))
    rm_config = tmp_path / "rm.toml"
    rm_config.write_text(
        f'[model]\npath = "{WARM}"\ndtype = "float32"\nzero_stage = 0\n'
        f'[data]\npath = "{train}"\neval_path = "{test}"\nmax_length = 32\n'
        "[train]\nepochs = 6\nbatch_size = 32\nmicro_batch_size = 16\nlearning_rate = 3e-3\n"
        f'warmup_steps = 10\n[output]\ndir = "{tmp_path / "rm"}"\n'
    )
    trained = subprocess.run(
        [sys.executable, "-m", "ferrule_trainer.cli", "rm", str(rm_config)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    reward_model = tmp_path / "rm" / "model"
    assert (reward_model / "reward_stats.json").exists()

    out = tmp_path / "ppo"
    overrides = [
        'trainer.estimator="gae"',
        'critic.init="reward_model"',
        "critic.learning_rate=1e-4",
        'rewards.function=""',
        f'rewards.model="{reward_model}"',
        "rewards.normalize=true",
        "trainer.learning_rate=5e-4",
        "loop.steps=30",
        "loop.eval_every=0",
        "eval.threshold=1.0",
        "output.checkpoint_every=0",
        "output.progress=false",
        f'output.dir="{out}"',
    ]
    command = [sys.executable, "-m", "ferrule_launcher.cli", str(ROOT / "examples" / "tiny.toml")]
    for item in overrides:
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    print(
        f"classic: reward-model score {before['reward']:.3f} -> {after['reward']:.3f}, "
        f"exact match {summary['accuracy_before']:.2f} -> {summary['accuracy_after']:.2f}"
    )
    assert after["reward"] > before["reward"] + 0.1  # the reward model's (normalised) score
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.05  # never shown to PPO
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/loss" in r for r in records)
