"""The RL train phase alone at 1.5B on one GPU: ferrule-trainer's `Actor` (DeepSpeed) against a
plain PyTorch loop on the same micro-batches and the same loss.

    python benchmarks/train_phase_gpu.py [--rows 512] [--response 512] [--tokens 8192]
        [--no-checkpointing] [--runs baseline,ours-0,ours-2] [--profile]

A Qwen2.5-1.5B-shaped policy (real vocabulary, random init, bf16) takes one on-policy GRPO
optimizer step over --rows rows of 12 prompt + --response response tokens (step_gpu.py's batch),
with k3 KL to given reference log-probabilities, in micro-batches of --tokens tokens, with
gradient checkpointing unless --no-checkpointing (both sides alike):
  ours:      Actor(zero_stage=2 or 0).train_epochs, as a policy rank runs it;
  baseline:  a loop of forward, the same loss, backward per micro-batch, then torch's AdamW.
Each in a process of its own; seconds per step are medians of --repeats after a warm-up (its
seconds reported too), MFU counts 6 N flops per token against an H100's 989 TFLOP/s. --compile
sets ours' compile_layers (the launcher's default); --profile adds the CUDA kernel time of one
step of each side by kind, and the top kernels. Last line: one JSON object, ratio = baseline s /
ours s (Actor, ZeRO-2).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder fails on "9.0a"
H100_BF16 = 989e12


def model_path() -> Path:
    from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model

    return tiny_model("qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)


def batch_of(rows: int, response: int, vocab: int = 151_000):
    import torch

    from ferrule_trainer.batch import Batch

    g = torch.Generator().manual_seed(0)
    prompt = 12
    ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    return Batch(
        input_ids=ids,
        attention_mask=torch.ones(rows, prompt + response, dtype=torch.long),
        response_mask=torch.ones(rows, response, dtype=torch.long),
        advantages=torch.randn(rows, response, generator=g),
        ref_logprobs=-12.0 + 0.1 * torch.randn(rows, response, generator=g),
    )


def run_ours(args, stage: int) -> list[float]:
    from ferrule_trainer.actor import Actor
    from ferrule_trainer.settings import EpochPlan, PolicyLoss

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    actor = Actor(
        model_path(),
        zero_stage=stage,
        dtype="bfloat16",
        learning_rate=1e-6,
        gradient_checkpointing=not args.no_checkpointing,
        attn_implementation="sdpa",
        compile_layers=args.compile,
    )
    batch = batch_of(args.rows, args.response)
    plan = EpochPlan(micro_batch_size=64, micro_batch_tokens=args.tokens)
    loss = PolicyLoss(kl_coef=0.001)
    return time_steps(lambda: actor.train_epochs(batch, plan, loss), args, "ours")


def run_baseline(args) -> list[float]:
    import torch
    from step_gpu import train_step  # the same baseline step as the whole-step benchmark
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(
        model_path(), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    if not args.no_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, betas=(0.9, 0.95))
    b = batch_of(args.rows, args.response).to("cuda")
    length = b.input_ids.shape[1]
    per = max(1, args.tokens // length)
    slices = [slice(i, min(i + per, b.rows)) for i in range(0, b.rows, per)]

    def step():
        train_step(
            policy,
            optimizer,
            slices,
            b.input_ids,
            b.attention_mask,
            b.advantages,
            b.ref_logprobs,
            b.response_mask,
        )

    return time_steps(step, args, "baseline")


def time_steps(step, args, side: str) -> list[float]:
    """Seconds of a warm-up and --repeats steps; with --profile the last step is profiled
    instead of timed (the profiler slows it)."""
    import torch

    times = []
    for i in range(args.repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if args.profile and i == args.repeats:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                step()
                torch.cuda.synchronize()
            report_profile(prof, side, time.perf_counter() - start)
            continue
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


KINDS = [  # (kind, pattern of CUDA kernel names), first match wins
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("optimizer", r"adam|multi_tensor"),
    ("copy", r"copy|memcpy|memset|cat_|CatArray|fill"),
    ("reduce", r"reduce|softmax|norm|sum|max|logsumexp|gather|scatter"),
]


def report_profile(prof, side: str, seconds: float) -> None:
    """The profiled step's CUDA kernel time by kind (stderr), and the top kernels."""
    import re

    kernels = [e for e in prof.key_averages() if str(e.device_type).endswith("CUDA")]
    total: dict[str, float] = {}
    for e in kernels:
        kind = next((k for k, pat in KINDS if re.search(pat, e.key, re.I)), "elementwise")
        total[kind] = total.get(kind, 0.0) + e.self_device_time_total / 1e6
    busy = sum(total.values())
    line = {"profile": side, "wall_s": round(seconds, 3), "kernels_s": round(busy, 3)}
    line.update({k: round(v, 3) for k, v in sorted(total.items(), key=lambda kv: -kv[1])})
    print(json.dumps(line), file=sys.stderr)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]
    for e in top:
        print(
            f"  {e.self_device_time_total / 1e6:8.3f} s {e.count:7d}x  {e.key[:110]}",
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--runs", default="baseline,ours-0,ours-2")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="ours: compile_layers")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: ours-0, ours-2, baseline
    args = parser.parse_args()
    if args.one:
        times = run_baseline(args) if args.one == "baseline" else run_ours(args, int(args.one[-1]))
        print("RESULT " + json.dumps(times), flush=True)
        return
    from ferrule_trainer.memory import ModelShape

    parameters = ModelShape.read(model_path()).parameters
    tokens = args.rows * (12 + args.response)
    checkpointing = not args.no_checkpointing
    result = dict(name="train_phase_gpu", rows=args.rows, tokens=tokens)
    result.update(micro_batch_tokens=args.tokens, checkpointing=checkpointing)
    for name in args.runs.split(","):
        argv = [sys.executable, __file__, "--one", name, "--rows", str(args.rows)]
        argv += ["--response", str(args.response), "--tokens", str(args.tokens)]
        argv += ["--repeats", str(args.repeats)] + (["--profile"] if args.profile else [])
        argv += ["--compile"] if args.compile else []
        argv += [] if checkpointing else ["--no-checkpointing"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=500)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if args.profile:
            print(
                "\n".join(
                    line for line in proc.stderr.splitlines() if line.startswith(("{", "  "))
                ),
                file=sys.stderr,
            )
        if proc.returncode or not lines:
            result[name] = {"error": proc.stderr[-1500:]}
            continue
        warmup, *times = json.loads(lines[-1][len("RESULT ") :])
        seconds = statistics.median(times)
        mfu = 6 * parameters * tokens / (seconds * H100_BF16)
        result[name] = {"seconds": seconds, "mfu": mfu, "warmup_s": warmup}
        print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    if "seconds" in result.get("ours-2", {}) and "seconds" in result.get("baseline", {}):
        result["ratio"] = result["baseline"]["seconds"] / result["ours-2"]["seconds"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
