"""Bit-exact resume at 1.5B on one GPU: the real `rlhf-launch` of the soak (soak_gpu.py's
issue-56 case: GRPO, hybrid, the transformers engine, 8 samples x up to 256 tokens of --prompts
prompts, temperature 1) with `[rollout] exact = true`, run uninterrupted for --steps steps, then again
killed with kill -9 once its checkpoint of step 2 is complete and resumed with --resume. Prints
one JSON line named exact_resume_gpu: both runs' final policy digests, the first step whose
reward or loss differs between them (none when the resume is exact) and whether the two runs
already differed before the kill (run-to-run nondeterminism, not the resume); ratio 1.0 when the
digests are equal, else 0.

    . scripts/gpu_env.sh && cd benchmarks && python exact_resume_gpu.py [--steps 4] [--prompts 16]

Exact mode's trainer is slow at this size (its forward runs attention a row at a time: 57 s of
train a step at 64 prompts on an H200), hence 16 prompts by default.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

from soak_gpu import SHAPE_1_5B, launch, logged_steps

EXACT = {
    "rollout__exact": "true",
    "output__checkpoint_every": 2,
    "output__export_every": 2,  # its seconds: time/export
    "loop__seed": 11,
}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def digest(out: Path) -> str | None:
    path = out / "summary.json"
    return json.loads(path.read_text())["weights_digest"]["policy"] if path.exists() else None


def first_difference(a: list[dict], b: list[dict]) -> int | None:
    keys = ("reward", "train/loss", "train/grad_norm")
    for x, y in zip(a, b, strict=False):
        if any(x.get(k) != y.get(k) for k in keys):
            return x["step"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps of each run (>= 3)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--out", type=Path, default=Path("/tmp/exact_resume_gpu"))
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(
            f"--steps must be at least 3 (a checkpoint at 2, one step after), got {args.steps}"
        )
    from ferrule_testkit import tiny_model

    model = tiny_model("qwen2", seed=3, **SHAPE_1_5B)
    keys = {**EXACT, "rollout__prompts_per_step": args.prompts}
    began = time.monotonic()
    whole, resumed = args.out / "whole", args.out / "resumed"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "exact_resume_gpu.log", "w") as log:
        launch(model, whole, args.steps, False, log, **keys).wait()
        first = launch(model, resumed, args.steps, False, log, **keys)
        checkpoint = resumed / "checkpoint" / "launcher.json"
        while first.poll() is None and not (
            checkpoint.exists() and json.loads(checkpoint.read_text())["step"] >= 2
        ):
            time.sleep(0.2)
        killed_after = logged_steps(resumed)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(60)
        before_kill = records(resumed)
        launch(model, resumed, args.steps, True, log, **keys).wait()
    a, b = digest(whole), digest(resumed)
    summary = json.loads((resumed / "summary.json").read_text()) if b else {}
    print(
        json.dumps(
            {
                "name": "exact_resume_gpu",
                "steps": args.steps,
                "prompts": args.prompts,
                "killed_after_step": killed_after[-1] if killed_after else 0,
                "resumed_from_step": summary.get("resumed_from_step"),
                "steps_logged": logged_steps(resumed),
                "differed_before_the_kill": first_difference(records(whole), before_kill),
                "first_step_that_differs": first_difference(records(whole), records(resumed)),
                "digest_uninterrupted": a,
                "digest_resumed": b,
                "wall_seconds": round(time.monotonic() - began, 1),
                "ratio": 1.0 if a and a == b else 0.0,
            }
        )
    )


if __name__ == "__main__":
    main()
