"""The memory planner against measured peaks, on one GPU: a Qwen2.5-1.5B-shaped policy (real
151,936-token vocabulary, random init, bf16) trained and scored by ferrule-trainer's `Actor` at
several plans (ZeRO stage, gradient checkpointing, micro-batch tokens, prompt / response
shares), each in a process of its own; and the transformers engine generating.

    python benchmarks/memory_gpu.py [--cases NAME,NAME] [--engine]

Per case: torch's peak reserved memory (what the allocator took from the GPU; the CUDA context
comes on top) against `ferrule_trainer.memory`'s estimate of the same phase. One JSON line per
case, then a summary line ending with the largest |estimate / measured - 1|.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder fails on "9.0a"
root = Path(__file__).resolve().parents[1]
for package in ("trainer", "config", "weightsync", "rollout", "testkit"):
    sys.path.insert(0, str(root / "packages" / package / "src"))

# name: (zero stage, checkpointing, rows, prompt tokens, response tokens, train)
CASES = {
    "z0-4k": (0, False, 8, 128, 384, True),
    "z0-8k": (0, False, 16, 128, 384, True),
    "z0-ckpt-8k": (0, True, 16, 128, 384, True),
    "z0-ckpt-16k": (0, True, 32, 128, 384, True),
    "z0-ckpt-8k-long-prompts": (0, True, 16, 384, 128, True),
    "z2-ckpt-8k": (2, True, 16, 128, 384, True),
    "z2-8k": (2, False, 16, 128, 384, True),
    "z3-ckpt-8k": (3, True, 16, 128, 384, True),
    "forward-8k": (0, False, 16, 128, 384, False),
    "forward-16k": (0, False, 32, 128, 384, False),
    # larger micro-batches, which the LM head on chunks of tokens lets fit
    "z2-12k": (2, False, 24, 128, 384, True),
    "z2-ckpt-32k": (2, True, 64, 128, 384, True),
    "forward-32k": (0, False, 64, 128, 384, False),
    # not fitted to: what packages/trainer/tests/test_memory_gpu.py checks the estimate against
    "check-z2-ckpt-12k-short-prompts": (2, True, 24, 16, 496, True),
    "check-z2-6k-half-prompts": (2, False, 12, 256, 256, True),
    "check-forward-12k-short-prompts": (0, False, 24, 16, 496, False),
}
CHECKS = [name for name in CASES if name.startswith("check-")]


def model_path() -> Path:
    from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model

    return tiny_model("qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)


def rl_batch(rows: int, prompt: int, response: int):
    """Every row prompt + response tokens long (no padding): the case's token count exactly."""
    import torch

    from ferrule_trainer.batch import Batch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151_000, (rows, prompt + response), generator=generator)
    return Batch(
        input_ids=ids,
        attention_mask=torch.ones(rows, prompt + response, dtype=torch.long),
        response_mask=torch.ones(rows, response, dtype=torch.long),
        advantages=torch.randn(rows, response, generator=generator),
    )


def measure(name: str, path: str) -> dict:
    """One case, in this process: the peak of its phase (the second step: the first one
    allocates the optimizer's states)."""
    import torch

    from ferrule_trainer.actor import Actor
    from ferrule_trainer.settings import EpochPlan, ForwardPlan, PolicyLoss

    stage, checkpointing, rows, prompt, response, train = CASES[name]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    actor = Actor(
        path,
        train=train,
        zero_stage=stage,
        dtype="bfloat16",
        gradient_checkpointing=checkpointing,
        attn_implementation="sdpa",
    )
    batch = rl_batch(rows, prompt, response)
    tokens = rows * (prompt + response)
    at_rest = torch.cuda.memory_reserved()
    seconds = []
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if train:
            plan = EpochPlan(micro_batch_size=rows, micro_batch_tokens=tokens)
            actor.train_epochs(batch, plan, PolicyLoss())
        else:
            actor.logprobs(batch, ForwardPlan(rows, tokens))
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return dict(
        case=name,
        tokens=tokens,
        response_share=response / (prompt + response),
        at_rest_gib=at_rest / 2**30,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
        seconds=seconds[-1],
    )


def estimate(name: str, path: str) -> float | None:
    try:
        from ferrule_trainer import memory
    except ImportError:
        return None
    stage, checkpointing, rows, prompt, response, train = CASES[name]
    shape = memory.ModelShape.read(path)
    tokens, share = rows * (prompt + response), response / (prompt + response)
    if train:
        phase = memory.policy_train_peak(
            shape,
            dtype="bfloat16",
            zero_stage=stage,
            ranks=1,
            checkpointing=checkpointing,
            tokens=tokens,
            response_share=share,
        )
    else:
        phase = memory.forward_peak(shape, "bfloat16", tokens, share)
    return phase / 2**30


def engine_case(path: str) -> dict:
    """The transformers engine generating 256 rows x 256 tokens at max_model_len 1024."""
    import torch

    from ferrule_rollout import SamplingSettings
    from ferrule_rollout.hf_engine import TransformersEngine

    torch.cuda.reset_peak_memory_stats()
    with TransformersEngine(path, dtype="bfloat16", max_model_len=1024) as engine:
        prompts = [[(7 * i + j) % 150_000 + 10 for j in range(128)] for i in range(32)]
        params = SamplingSettings(n=8, max_tokens=256, temperature=1.0, ignore_eos=True)
        engine.generate(prompts, params)
        peak = torch.cuda.max_memory_reserved() / 2**30
    return dict(case="engine", peak_reserved_gib=peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(c for c in CASES if c not in CHECKS))
    parser.add_argument("--engine", action="store_true", help="also the transformers engine")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: this case, JSON to stdout
    args = parser.parse_args()
    path = str(model_path())
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, path)), flush=True)
        return
    worst = 0.0
    for name in args.cases.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=300
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(json.dumps(dict(case=name, error=(proc.stderr or proc.stdout)[-1500:])))
            continue
        result = json.loads(lines[-1][len("RESULT ") :])
        guess = estimate(name, path)
        if guess is not None:
            result["estimate_gib"] = guess
            result["error"] = guess / result["peak_reserved_gib"] - 1
            worst = max(worst, abs(result["error"]))
        print(json.dumps(result), flush=True)
    if args.engine:
        print(json.dumps(engine_case(path)), flush=True)
    print(json.dumps(dict(name="memory_gpu", cases=args.cases, worst_error=worst)))


if __name__ == "__main__":
    main()
