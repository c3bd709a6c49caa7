"""Our DPO step against a plain-torch DPO loop with the same numerics, on the same batches.

    uv run python benchmarks/dpo_tiny.py [--model PATH] [--pairs 32] [--micro 16] [--rounds 7]

Ours: ferrule-trainer's policy and frozen reference (`Actor`, DeepSpeed ZeRO-0, float32), one
optimizer step through `engine.optimizer_step` with `dpo.dpo_pair_loss`. Baseline: the same
Hugging Face model in plain torch: the reference's log-probabilities under no_grad, the policy's,
-log sigmoid(beta h) by hand, backward per micro-batch, gradient clipping at 1.0 and AdamW
(the same learning rate, betas, weight decay). Rounds alternate between the two, each round a
few steps; both start from the same weights. The steps' losses are compared (they must agree:
the same numerics), and pairs per second are the median over rounds.

Prints one JSON line: {"ours_pairs_per_s", "baseline_pairs_per_s", ..., "ratio"} (ratio = ours
/ baseline; goal >= 0.9 on CPU). Default model: the tiny example's policy (CPU sized).
"""

import argparse
import json
import os
import random
import statistics
import string
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def pairs(count: int, seed: int):
    from ferrule_trainer.preference import Pair

    rng = random.Random(seed)
    made = []
    for _ in range(count):
        word = "".join(rng.sample(string.ascii_lowercase, 3))
        made.append(Pair(f"Reverse the string {word}. Answer:", f" {word[::-1]}", f" {word}"))
    return made


def baseline_step(policy, reference, optimizer, micro_batches, pairs_in_step, beta):
    from ferrule_trainer.dpo import response_logprobs

    total = 0.0
    for mb in micro_batches:
        with torch.no_grad():
            ref, _ = response_logprobs(reference, mb)
        logps, _ = response_logprobs(policy, mb)
        half = logps.shape[0] // 2
        h = (logps[:half] - ref[:half]) - (logps[half:] - ref[half:])
        loss = -F.logsigmoid(beta * h).sum() / pairs_in_step
        loss.backward()
        total += float(loss)
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples" / "tiny" / "model"))
    parser.add_argument("--pairs", type=int, default=32, help="pairs per optimizer step")
    parser.add_argument("--micro", type=int, default=16, help="pairs per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.rounds < 2:  # the first round warms up: no timed round would be left to report
        parser.error(f"--rounds must be at least 2 (the first warms up), got {args.rounds}")

    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ferrule_trainer import engine
    from ferrule_trainer.actor import Actor
    from ferrule_trainer.dpo import DPOLossConfig, dpo_pair_loss
    from ferrule_trainer.preference import pair_batch

    torch.manual_seed(0)
    d, lr, betas = DPOLossConfig(beta=0.1), 1e-4, (0.9, 0.95)
    common = dict(dtype="float32", zero_stage=0, seed=0)
    ours = Actor(args.model, learning_rate=lr, betas=betas, max_grad_norm=1.0, **common)
    our_reference = Actor(args.model, train=False, **common)
    device = engine.device()  # both on the same device: a GPU where there is one
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    policy.train()
    reference.eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=betas, weight_decay=0.0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = pairs(args.pairs * args.steps, seed=1)
    pad_id = tokenizer.pad_token_id
    steps = [
        [
            pair_batch(tokenizer, data[i + j : i + j + args.micro], 64, pad_id).to(device)
            for j in range(0, args.pairs, args.micro)
        ]
        for i in range(0, len(data), args.pairs)
    ]

    def ours_round() -> list[float]:
        return [
            engine.optimizer_step(
                ours.engine,
                micro_batches,
                lambda mb: dpo_pair_loss(ours.engine, our_reference.engine, mb, args.pairs, d),
            )["loss"]
            for micro_batches in steps
        ]

    def baseline_round() -> list[float]:
        return [
            baseline_step(policy, reference, optimizer, mbs, args.pairs, d.beta) for mbs in steps
        ]

    def timed(run) -> tuple[list[float], float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        losses = run()  # each step's loss is read on the host, which waits for the step
        return losses, time.perf_counter() - started

    timings = {"ours": [], "baseline": []}
    losses = {}
    for round_ in range(args.rounds):
        for name, run in (("ours", ours_round), ("baseline", baseline_round)):
            round_losses, seconds = timed(run)
            losses.setdefault(name, round_losses)
            if round_:  # the first round of each warms up (allocations, first kernels)
                timings[name].append(seconds)
    per_round = args.pairs * args.steps
    ours_rate = per_round / statistics.median(timings["ours"])
    baseline_rate = per_round / statistics.median(timings["baseline"])
    agree = max(abs(a - b) for a, b in zip(losses["ours"], losses["baseline"], strict=True))
    print(
        json.dumps(
            {
                "benchmark": "dpo_tiny",
                "model": Path(args.model).name,
                "pairs_per_step": args.pairs,
                "micro_batch_pairs": args.micro,
                "rounds": args.rounds - 1,
                "first_round_losses_max_difference": agree,
                "ours_pairs_per_s": round(ours_rate, 2),
                "baseline_pairs_per_s": round(baseline_rate, 2),
                "ratio": round(ours_rate / baseline_rate, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
