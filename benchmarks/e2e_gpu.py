"""The hybrid engine on one GPU: weights over CUDA IPC against weights through host memory.

    uv run python benchmarks/e2e_gpu.py [--steps 16] [--warmup 4] [--set KEY=VALUE ...]

Runs the real `rlhf-launch` (Ray, DeepSpeed, the transformers rollout engine, the reward server)
three times on the same work: examples/tiny.toml with ferrule-testkit's 132M-parameter Qwen2 in
bf16, placement "colocate_all" on one GPU, the policy's states offloaded and the engine asleep
between phases.
  ours:      weights from the policy to the engine over CUDA IPC ([rollout] transport "auto")
  baseline:  the same run, weights through host memory ([rollout] transport "host": shared
             memory, as the launcher did on GPUs before the GPU path)
  resident:  ours without offload and sleep, for the memory figures only
Seconds per RL step are the median over the steps after `--warmup`, from the wall clock each
step's metrics record; sync_share is the median weight-sync time over the median step. The GPU
memory in use (every process on the device) at the end of generation and of training is the
median over the same steps. Last line: one JSON object, ratio = baseline s/step / ours s/step
(goal >= 1.0) with ours' sync_share (goal <= 0.02).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_launcher_gpu import COMMON, EXAMPLE, model_100m  # noqa: E402

HYBRID = ['ray.placement="colocate_all"', "trainer.offload_between_phases=true"]
HYBRID += ["rollout.sleep_between_phases=true"]


def run(name: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    overrides = [
        f'model.path="{model_100m()}"',
        *COMMON,
        f"loop.steps={steps}",
        "sft.steps=0",
        f'output.dir="{out}"',
        *extra,
    ]
    command = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for item in overrides:
        command += ["--set", item]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{name} run failed ({result.returncode}):\n{result.stderr[-4000:]}")
    print(f"{name}: {steps} steps in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def measure(records: list[dict], warmup: int) -> dict:
    timed = range(warmup, len(records))
    step_s = [records[i]["wall_seconds"] - records[i - 1]["wall_seconds"] for i in timed]
    sync_s = [records[i]["time/sync"] for i in timed]
    result = {
        "step_s": round(statistics.median(step_s), 4),
        "sync_s": round(statistics.median(sync_s), 4),
        "sync_share": round(statistics.median(sync_s) / statistics.median(step_s), 4),
    }
    for phase in ("generate", "train"):
        key = f"gpu/used_gb_{phase}"
        values = [records[i][key] for i in timed if key in records[i]]
        result[f"gpu_gb_{phase}"] = round(statistics.median(values), 2) if values else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and less than --steps")
    with tempfile.TemporaryDirectory(prefix="e2e_gpu-") as tmp:
        tmp = Path(tmp)
        ours = measure(run("ours", args.steps, tmp / "ours", HYBRID + args.set), args.warmup)
        host = ['rollout.transport="host"', *HYBRID, *args.set]
        baseline = measure(run("baseline", args.steps, tmp / "host", host), args.warmup)
        resident_overrides = ['ray.placement="colocate_all"', *args.set]
        resident = measure(run("resident", args.steps, tmp / "res", resident_overrides), 1)
    print(
        json.dumps(
            {
                "name": "e2e_gpu_hybrid",
                "unit": "seconds per RL step (median after warm-up)",
                "steps": args.steps,
                "warmup": args.warmup,
                "ours_detail": ours,
                "baseline_detail": baseline,
                "memory_gb": {
                    "offload_and_sleep": {k: ours[f"gpu_gb_{k}"] for k in ("generate", "train")},
                    "resident": {k: resident[f"gpu_gb_{k}"] for k in ("generate", "train")},
                },
                "ours": ours["step_s"],
                "baseline": baseline["step_s"],
                "goal": "ratio >= 1.0; ours sync_share <= 0.02",
                "ratio": round(baseline["step_s"] / ours["step_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
