"""The asynchronous loop against the synchronous one: the tiny example, end to end, same run.

    uv run python benchmarks/e2e_tiny.py [--steps 40] [--warmup 5] [--set KEY=VALUE ...]

Runs the real `rlhf-launch` (Ray, vLLM, DeepSpeed, the reward server, weight sync) on
examples/tiny.toml twice with the same configuration and number of steps, once with
`loop.mode = "sync"` and once with `loop.mode = "async"` (max_staleness 1), no evaluation
until the end. Steps per second come from the wall clock each step's metrics record, after
`--warmup` steps (start-up, first compilations), so the start-up of Ray and the engines is not
counted. Also reported, per mode: the mean time split of a step between generate, score, train
and sync (each phase timed where it runs; in the async loop generate and score overlap train),
and the weight sync's share of the wall time of a step.

ratio = async steps/s / sync steps/s (goal >= 1.3 where generation and training take comparable
time); `sync_share` of the async loop: goal <= 0.05. Last line: one JSON object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny.toml"
PHASES = ("generate", "score", "train", "sync")


def run(mode: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    overrides = [
        f"loop.steps={steps}",
        f'loop.mode="{mode}"',
        "loop.eval_every=0",
        "output.checkpoint_every=0",
        "output.progress=false",
        f'output.dir="{out}"',
        *extra,
    ]
    if mode == "async":
        overrides.append("loop.max_staleness=1")
    command = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for item in overrides:
        command += ["--set", item]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{mode} run failed ({result.returncode}):\n{result.stderr[-4000:]}")
    print(f"{mode}: {steps} steps in {time.monotonic() - started:.0f}s", file=sys.stderr)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def measure(records: list[dict], warmup: int) -> dict:
    timed = records[warmup:]
    span = timed[-1]["wall_seconds"] - records[warmup - 1]["wall_seconds"]
    step_seconds = span / len(timed)
    phases = {p: statistics.mean(r[f"time/{p}"] for r in timed) for p in PHASES}
    return {
        "steps_per_s": len(timed) / span,
        "step_s": round(step_seconds, 3),
        "time_split_s": {p: round(t, 3) for p, t in phases.items()},
        "sync_share": round(phases["sync"] / step_seconds, 4),
        "reward_first": records[0]["reward"],
        "reward_last": records[-1]["reward"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="for both runs"
    )
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and less than --steps")
    with tempfile.TemporaryDirectory(prefix="e2e_tiny-") as tmp:
        sync = measure(run("sync", args.steps, Path(tmp) / "sync", args.set), args.warmup)
        async_ = measure(run("async", args.steps, Path(tmp) / "async", args.set), args.warmup)
    print(
        json.dumps(
            {
                "name": "e2e_tiny",
                "unit": "steps/s after warm-up",
                "steps": args.steps,
                "warmup": args.warmup,
                "cpus": os.cpu_count(),
                "sync": sync,
                "async": async_,
                "ours": round(async_["steps_per_s"], 4),
                "baseline": round(sync["steps_per_s"], 4),
                "goal": "ratio >= 1.3; async sync_share <= 0.05",
                "ratio": round(async_["steps_per_s"] / sync["steps_per_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
