"""How long a sequence one PPO step can train on 2 GPUs: each GPU a whole sequence
(sequence_parallel = 1, data parallel) against both GPUs sharing each sequence (= 2).

    python benchmarks/sequence_parallel_gpu.py [--lengths 8192,16384,32768,65536] [--steps 3]
    python benchmarks/sequence_parallel_gpu.py --no-checkpointing --lengths 16384,32768,65536
    python benchmarks/sequence_parallel_gpu.py --model tiny --lengths 64,128   # on CPU (gloo)

A Qwen2.5-1.5B-shaped policy (real vocabulary, random init, bf16, ZeRO-2, gradient checkpointing)
(--no-checkpointing: every layer's activations kept, where a rank's memory runs out ~10x sooner)
takes --steps on-policy GRPO steps, k3 KL to given reference log-probabilities, on rows of
--lengths tokens (12 prompt, the rest response, no padding: the causal kernels). With
sequence_parallel = 1 each of the 2 ranks trains its own row; with 2 they share one row. Each
(length, sequence_parallel) runs in fresh processes; a CUDA out-of-memory is reported as such.
Per case a JSON line: seconds a step (median after the first), peak GiB a GPU (torch's max
allocated, the larger rank's), response tokens a second a GPU. Last line: one JSON object, ratio =
the longest length that trains with 2 / the longest with 1.
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
WORLD = 2
PROMPT = 12


def model_path(name: str) -> Path:
    from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model

    if name == "tiny":  # 4 heads: they split over 2 ranks
        return tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    return tiny_model("qwen2", vocab_size=QWEN25_VOCAB, dtype="bfloat16", **QWEN25_1_5B)


def worker(args) -> None:
    """One rank: the Actor, --steps steps on its row(s), its figures to --out/<rank>.json."""
    import torch

    from ferrule_trainer.actor import Actor
    from ferrule_trainer.batch import Batch
    from ferrule_trainer.settings import EpochPlan, PolicyLoss

    rank, cuda = int(os.environ["RANK"]), torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    out = Path(args.out) / f"{rank}.json"
    try:
        actor = Actor(
            args.model_dir,
            zero_stage=2,
            dtype="bfloat16" if cuda else "float32",
            learning_rate=1e-6,
            gradient_checkpointing=args.checkpointing,
            sequence_parallel=args.shared,
        )
        vocab = actor.module.config.vocab_size
        g = torch.Generator().manual_seed(rank // args.shared)  # a group's ranks: the same row
        response = args.length - PROMPT
        batch = Batch(
            input_ids=torch.randint(0, vocab, (1, args.length), generator=g),
            attention_mask=torch.ones(1, args.length, dtype=torch.long),
            response_mask=torch.ones(1, response, dtype=torch.long),
            advantages=torch.randn(1, response, generator=g),
            ref_logprobs=-12.0 + 0.1 * torch.randn(1, response, generator=g),
        )
        plan = EpochPlan(micro_batch_size=1, micro_batch_tokens=args.length)
        seconds = []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            actor.train_epochs(batch, plan, PolicyLoss(kl_coef=0.001))
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        result = {"seconds": seconds, "peak_gib": peak, "response_tokens": response}
    except torch.OutOfMemoryError as err:
        result = {"oom": str(err).splitlines()[0]}
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no teardown: a gloo / NCCL group left after an OOM can hang it


def run_case(args, length: int, shared: int, folder: Path) -> dict:
    from ferrule_testkit.gloo import free_port

    folder.mkdir(parents=True)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(WORLD),
    )
    if args.model == "tiny":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    command = [
        sys.executable, __file__, "--worker", "--model-dir", str(args.model_dir),
        "--out", str(folder), "--length", str(length), "--shared", str(shared),
        "--steps", str(args.steps), *([] if args.checkpointing else ["--no-checkpointing"]),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(WORLD)
    ]
    for proc in procs:
        proc.wait(timeout=args.timeout)
    ranks = [json.loads((folder / f"{r}.json").read_text()) for r in range(WORLD)]
    case = {"length": length, "sequence_parallel": shared}
    if any("oom" in r for r in ranks):
        return {**case, "oom": next(r["oom"] for r in ranks if "oom" in r)}
    step = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(1, args.steps))
    tokens = ranks[0]["response_tokens"] * WORLD // shared  # the step's, over both GPUs
    peaks = [r["peak_gib"] for r in ranks if r["peak_gib"] is not None]
    return {
        **case,
        "step_s": round(step, 3),
        "peak_gib": round(max(peaks), 1) if peaks else None,
        "tokens_per_s_per_gpu": round(tokens / step / WORLD),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("1.5b", "tiny"), default="1.5b")
    parser.add_argument("--lengths", default="8192,16384,32768,65536")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--no-checkpointing", dest="checkpointing", action="store_false",
        help="keep every layer's activations (no gradient checkpointing)",
    )  # fmt: skip
    parser.add_argument("--out", default="/tmp/sequence_parallel_gpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shared", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step (allocation, warm-up) is not timed")
    args.model_dir = model_path(args.model)
    root = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    longest = {1: 0, 2: 0}
    for length in map(int, args.lengths.split(",")):
        for shared in (1, 2):
            case = run_case(args, length, shared, root / f"{length}-{shared}")
            print(json.dumps(case), flush=True)
            if "oom" not in case:
                longest[shared] = max(longest[shared], length)
    print(
        json.dumps(
            {
                "name": "sequence_parallel_gpu",
                "model": args.model,
                "checkpointing": args.checkpointing,
                "longest_whole": longest[1],
                "longest_shared": longest[2],
                "ratio": round(longest[2] / longest[1], 2) if longest[1] else None,
            }
        )
    )


if __name__ == "__main__":
    main()
