"""A long GPU run that must not die: the real `rlhf-launch` at 1.5B (the issue-56 case: GRPO,
hybrid, the transformers engine, 64 prompts x 8 samples x up to 256 tokens, temperature 1, the
memory plan's defaults), the launcher killed with kill -9 after a checkpoint and resumed, then
the rollout engine killed. Prints one JSON line named soak_gpu whose ratio is the steps completed
over the steps planned (goal 1.0), with whether the steps are contiguous, the steps skipped for
non-finite gradients and whether every engine ended with the policy's weights.

    . scripts/gpu_env.sh && python benchmarks/soak_gpu.py [--steps 30] [--seconds 530]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny.toml"
SHAPE_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def command(model: Path, out: Path, steps: int, resume: bool, **extra) -> list[str]:
    """The issue-56 case's `rlhf-launch` command line; `extra` keys (dots as "__") override."""
    keys = {
        "model.path": f'"{model}"',
        "model.dtype": '"bfloat16"',
        "rollout.backend": '"transformers"',
        "rollout.prompts_per_step": 64,
        "rollout.samples_per_prompt": 8,
        "rollout.max_tokens": 256,
        "rollout.temperature": 1.0,
        "rollout.max_model_len": 512,
        "loop.steps": steps,
        "loop.eval_every": 0,
        "sft.steps": 0,
        "trainer.learning_rate": 1e-6,
        "task.eval_prompts": 4,
        "ray.placement": '"colocate_all"',
        "ray.num_cpus": 8,
        "ray.cpus_per_role": 1,
        "ray.gpus_per_role": 1,
        "output.checkpoint_every": 10,
        "output.progress": "false",
        "output.dir": f'"{out}"',
        **{key.replace("__", "."): value for key, value in extra.items()},
    }
    args = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for key, value in keys.items():
        args += ["--set", f"{key}={value}"]
    return [*args, "--resume"] if resume else args


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines]


def launch(model, out, steps, resume, log, **extra) -> subprocess.Popen:
    return subprocess.Popen(
        command(model, out, steps, resume, **extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # kill -9 of the session: the launcher and all it started
    )


def wait_until(process, out: Path, step: int, deadline: float) -> bool:
    """Whether the run logged `step` before `deadline` while still running."""
    while time.monotonic() < deadline and process.poll() is None:
        if logged_steps(out) and logged_steps(out)[-1] >= step:
            return True
        time.sleep(0.5)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps planned")
    parser.add_argument("--seconds", type=float, default=530, help="wall-clock budget")
    parser.add_argument("--out", type=Path, default=Path("/tmp/soak_gpu"))
    args = parser.parse_args()
    if args.steps < 20:
        parser.error(
            f"--steps must be at least 20 (kill -9 at 14, the engine at steps - 6), got {args.steps}"
        )
    from ferrule_testkit import tiny_model

    model = tiny_model("qwen2", seed=3, **SHAPE_1_5B)
    began = time.monotonic()
    deadline = began + args.seconds
    kill_launcher_at, kill_engine_at = 14, args.steps - 6  # checkpoints every 10 steps
    with open(args.out.parent / "soak_gpu.log", "w") as log:
        first = launch(model, args.out, args.steps, False, log)
        reached = wait_until(first, args.out, kill_launcher_at, deadline)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(60)
        saved = json.loads((args.out / "checkpoint" / "launcher.json").read_text())["step"]
        second = launch(model, args.out, args.steps, True, log)
        if reached and wait_until(second, args.out, kill_engine_at, deadline):
            roles = json.loads((args.out / "roles.json").read_text())
            os.kill(roles["rollout-0"]["pid"], signal.SIGKILL)
        try:
            second.wait(max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(60)
    steps = logged_steps(args.out)
    records = [json.loads(x) for x in (args.out / "metrics.jsonl").read_text().splitlines()]
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    digests = summary.get("weights_digest", {})
    print(
        json.dumps(
            {
                "name": "soak_gpu",
                "steps_planned": args.steps,
                "steps_completed": len(steps),
                "contiguous": steps == list(range(1, len(steps) + 1)),
                "skipped_steps": [r["step"] for r in records if r.get("train/skipped")],
                "resumed_from_step": saved,
                "engine_restarts": max((r.get("rollout/restarts", 0) for r in records), default=0),
                "engines_hold_the_policy": bool(digests)
                and all(d == digests["policy"] for d in digests.get("engines", [None])),
                "train_seconds_median": sorted(r["time/train"] for r in records)[len(records) // 2],
                "checkpoint_seconds": [
                    round(r["time/checkpoint"], 1) for r in records if "time/checkpoint" in r
                ],
                "wall_seconds": round(time.monotonic() - began, 1),
                "ratio": round(len(steps) / args.steps, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
