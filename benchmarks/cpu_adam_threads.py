"""DeepSpeed's CPU Adam (the optimizer of an offloaded policy) on the threads the launcher gives a
rank against the threads Ray alone would give it.

    python benchmarks/cpu_adam_threads.py [--params 1e9] [--steps 3] [--sweep 1,2,4,8,16]

Ray sets OMP_NUM_THREADS to the CPUs an actor asked for: 1 at the default [ray] cpus_per_role
(0.5). With [trainer] offload_optimizer on a GPU machine the launcher sets it instead to
`placement.optimizer_threads`: the machine's cores shared by the ranks that step (one policy
rank here). Each figure is one process (OMP_NUM_THREADS is read once, at start-up) timing
`DeepSpeedCPUAdam.step` over --params float32 parameters with gradients (16 bytes a parameter of
host memory: 16 GB at 1e9), the median of --steps steps after a warm-up step. Last line: one JSON
object ending with ratio = Ray's seconds a step / ours.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny.toml"


def step_seconds(params: int, steps: int) -> dict:
    """In this process: DeepSpeed CPU Adam's step over `params` parameters, median of `steps`."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    weight = torch.nn.Parameter(torch.zeros(params))
    weight.grad = torch.full((params,), 1e-3)  # randn on one thread takes longer than steps
    optimizer = DeepSpeedCPUAdam([weight], lr=1e-4)
    optimizer.step()  # the states' first touch
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return {"step_s": statistics.median(times), "torch_threads": torch.get_num_threads()}


def measured(threads: int, params: int, steps: int) -> dict:
    """step_seconds in a fresh process with OMP_NUM_THREADS = `threads`."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    command = [sys.executable, __file__, "--child", f"--params={params}", f"--steps={steps}"]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"CPU Adam with {threads} threads failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.splitlines()[-1])
    result.update(threads=threads, params_per_s=params / result["step_s"])
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def launcher_threads() -> tuple[int, int]:
    """(ours, Ray's): the threads the launcher gives the policy rank of a one-rank GPU run with
    the optimizer offloaded, and what Ray's OMP_NUM_THREADS would have been."""
    from unittest import mock

    from ferrule_launcher.load import load_config
    from ferrule_launcher.placement import optimizer_threads

    config = load_config(EXAMPLE, {"trainer.offload_optimizer": True})
    with mock.patch("ferrule_launcher.placement.has_cuda", return_value=True):
        ours = optimizer_threads(config)
    return ours, max(1, int(config.ray.cpus_per_role))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sweep", default="", help="more thread counts to time, comma-separated")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    params = int(args.params)
    if args.child:
        print(json.dumps(step_seconds(params, args.steps)))
        return
    ours_threads, ray_threads = launcher_threads()
    ray = measured(ray_threads, params, args.steps)
    ours = measured(ours_threads, params, args.steps)
    sweep = [measured(int(t), params, args.steps) for t in args.sweep.split(",") if t]
    result = dict(name="cpu_adam_threads", cores=len(os.sched_getaffinity(0)), params=params)
    result.update(sweep=sweep, ray=ray, ours=ours, ratio=ray["step_s"] / ours["step_s"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
