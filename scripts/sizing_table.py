"""What fits where, computed by the memory plan (nothing is run): GRPO with a reference at the
Qwen2.5 7B, 14B and 32B shapes on 8 and 16 GPUs of 80 GiB (8 a node, 1 TiB of host memory a
node), hybrid (every GPU a policy rank, its reference and a vLLM engine that sleeps while they
train) or split (half the GPUs policy ranks with their references, half vLLM engines, one GPU
each), 4096-token responses. One markdown row per case: the plan's choices, each GPU's peak and each node's host
memory against what the plan may fill, and why a case does not fit.

    python scripts/sizing_table.py              # docs/quickstart-gpu.md's table
    python scripts/sizing_table.py --check      # fails where the docs' table is not today's
    rlhf-launch run.toml --plan --set ray.gpu_memory_gb=80 ...   # one case, every process
"""

import sys
import tempfile
from pathlib import Path

from ferrule_launcher.cli import parse_overrides
from ferrule_launcher.load import load_config
from ferrule_launcher.plan import HEADROOM, HOST_HEADROOM
from ferrule_launcher.resolve import resolve
from ferrule_testkit import shape_config
from ferrule_trainer.memory import GiB

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "quickstart-gpu.md"
GPU_GB, HOST_GB, PER_NODE = 80, 1024, 8


def case(shape: str, gpus: int, layout: str) -> list[str]:
    common = [
        f'model.path="{shape_config(shape)}"',
        'model.dtype="bfloat16"',
        "sft.steps=0",
        'rollout.backend="vllm"',
        "rollout.prompts_per_step=128",
        "rollout.samples_per_prompt=8",
        "rollout.max_tokens=4096",
        "rollout.max_model_len=4608",
        "trainer.kl_coef=0.001",
        "ray.gpus_per_role=1",
        f"ray.gpu_memory_gb={GPU_GB}",
        f"ray.host_memory_gb={HOST_GB}",
        f"ray.gpus_per_node={PER_NODE}",
    ]
    if layout == "hybrid":
        return [
            *common,
            'ray.placement="colocate_all"',
            f"trainer.ranks={gpus}",
            f"rollout.engines={gpus}",
            "rollout.sleep_between_phases=true",
        ]
    # vLLM's share below the plan's 90% fill (its CUDA context comes on top); one GPU an engine:
    # tensor parallelism would give every role ([ray] gpus_per_role) as many GPUs
    return [
        *common,
        'ray.placement="colocate"',
        f"trainer.ranks={gpus // 2}",
        f"rollout.engines={gpus // 2}",
        "rollout.gpu_memory_utilization=0.85",
    ]


def row(shape: str, gpus: int, layout: str) -> str:
    with tempfile.TemporaryDirectory() as out:
        items = [*case(shape, gpus, layout), f'output.dir="{out}"']
        config = load_config(ROOT / "examples" / "tiny.toml", parse_overrides(items))
        plan = resolve(config, refuse=False).plan
    t = plan.trainer
    keys = f"ZeRO-{t.zero_stage}, {t.micro_batch_tokens // 1024}k-token micro-batches"
    for key, name in (
        ("gradient_checkpointing", "checkpointing"),
        ("offload_optimizer", "CPU Adam"),
        ("offload_params", "weights offloaded"),
        ("offload_between_phases", "states out between phases"),
    ):
        if getattr(t, key):
            keys += f", {name}"
    peak, phase, index = plan.peak()
    holders = ", ".join(f"{h.role} {getattr(h, phase) / GiB:.0f}" for h in plan.gpus[index])
    gpu = f"{peak / GiB:.0f} ({holders})"
    host = f"{plan.host.bytes / GiB:.0f}"
    short = []
    if not plan.gpu_fits():
        biggest = max(plan.gpus[index], key=lambda h: getattr(h, phase))
        short.append(f"the {biggest.role}'s GPU ({phase} phase)")
    if not plan.host_fits():
        short.append("host memory")
    verdict = "no: " + " and ".join(short) if short else "fits"
    return f"| {shape.upper()} | {gpus} ({layout}) | {keys} | {gpu} | {host} | {verdict} |"


def table() -> str:
    lines = [
        f"| model | GPUs | the plan's [trainer] choice | GPU peak, GiB (of {HEADROOM:.0%} x "
        f"{GPU_GB}) | host a node, GiB (of {HOST_HEADROOM:.0%} x {HOST_GB}) | fits |",
        "|---|---|---|---|---|---|",
    ]
    for shape in ("7b", "14b", "32b"):
        for gpus in (8, 16):
            for layout in ("hybrid", "split"):
                lines.append(row(shape, gpus, layout))
    return "\n".join(lines)


def main() -> None:
    text = table()
    if "--check" in sys.argv[1:]:
        if text not in DOCS.read_text():
            sys.exit(f"{DOCS} does not hold today's table: run scripts/sizing_table.py")
        return
    print(text)


if __name__ == "__main__":
    main()
