"""Micro-batches by tokens against micro-batches by rows, on one GPU: the same RL train step and
log-prob pass of a Qwen2.5-0.5B-shaped policy (real vocabulary, random init, bf16, ZeRO-2).

    python benchmarks/micro_batches_gpu.py [--rows 64] [--steps 3] [--tokens 8192]

A GRPO-like batch of --rows samples with long-tailed response lengths (16-1024 tokens) after
64-192-token prompts, trained three ways, one after the other, by the same policy:
  rows:    micro-batches of --micro rows in batch order (what micro_batch_size alone did);
  tokens:  rows sorted by length into micro-batches of --tokens padded tokens (micro_batch_tokens);
  packed:  the same budget, each micro-batch one row without padding (pack_sequences).
Each way's loss is reported after the steps of the ways before it, so the three differ by
those updates (tests/test_micro_batches.py checks that the split leaves loss and gradients
unchanged; the log-prob passes, which change no weights, are compared here too). The figures
are seconds per optimizer step and per log-prob pass (medians after a warm-up) and peak GPU
memory. The last line is one
JSON object; ratios are rows / tokens and rows / packed (higher is better). ferrule_trainer is
imported from this source tree; needs torch, transformers, deepspeed and pydantic.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # DeepSpeed's op builder fails on "9.0a"
root = Path(__file__).resolve().parents[1]
for package in ("trainer", "config", "weightsync"):
    sys.path.insert(0, str(root / "packages" / package / "src"))
sys.path.insert(0, str(root / "benchmarks"))

import torch  # noqa: E402
from trainer_gpu import qwen2_05b_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from ferrule_trainer.actor import Actor  # noqa: E402
from ferrule_trainer.batch import Batch  # noqa: E402
from ferrule_trainer.settings import EpochPlan, ForwardPlan, PolicyLoss  # noqa: E402


def rl_batch(rows: int, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(64, 193, (rows // 8,), generator=generator).repeat_interleave(8)
    # long-tailed, as RL responses are: log-uniform over 16-1024 tokens
    responses = (16 * 64 ** torch.rand(rows, generator=generator)).long().clamp(16, 1024)
    P, R = int(prompts.max()), int(responses.max())
    ids = torch.randint(0, 151_000, (rows, P + R), generator=generator)
    attention = torch.zeros(rows, P + R, dtype=torch.long)
    for row in range(rows):
        attention[row, P - prompts[row] : P + responses[row]] = 1
    advantages = torch.randn(rows, R, generator=generator)
    return Batch(ids, attention, attention[:, P:].clone(), advantages=advantages)


def timed(fn, repeats: int) -> tuple[float, object, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, result = [], None
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), result, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    directory = tempfile.mkdtemp()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qwen2_05b_config(), dtype=torch.bfloat16).save_pretrained(
        directory
    )
    actor = Actor(directory, zero_stage=2, dtype="bfloat16", learning_rate=1e-7)
    batch = rl_batch(args.rows)
    real = batch.attention_mask[:, -batch.response_len :].bool()
    tokens = int(batch.attention_mask.sum())
    ways = {
        "rows": ForwardPlan(micro_batch_size=args.micro),
        "tokens": ForwardPlan(micro_batch_size=args.rows, micro_batch_tokens=args.tokens),
        "packed": ForwardPlan(args.rows, args.tokens, packed=True),
    }
    result = {"device": torch.cuda.get_device_name(), "rows": args.rows, "real_tokens": tokens}
    logprobs = {}
    for name, way in ways.items():
        seconds, out, peak = timed(lambda way=way: actor.logprobs(batch, way), args.steps)
        logprobs[name] = out
        result[f"logprobs_s/{name}"], result[f"logprobs_peak_gib/{name}"] = seconds, peak
    batch = batch.replace(old_logprobs=logprobs["rows"])
    for name in ("tokens", "packed"):
        diff = (logprobs[name] - logprobs["rows"])[real].abs()
        result[f"logprobs_max_abs_diff/{name}"] = float(diff.max())
        result[f"logprobs_mean_abs_diff/{name}"] = float(diff.mean())
    for name, way in ways.items():
        plan = EpochPlan(
            micro_batch_size=way.micro_batch_size,
            micro_batch_tokens=way.micro_batch_tokens,
            pack_sequences=way.packed,
        )
        seconds, metrics, peak = timed(
            lambda p=plan: actor.train_epochs(batch, p, PolicyLoss()), args.steps
        )
        result[f"train_s/{name}"], result[f"train_peak_gib/{name}"] = seconds, peak
        result[f"loss/{name}"] = metrics["loss"]
    for name in ("tokens", "packed"):
        result[f"train_ratio/{name}"] = result["train_s/rows"] / result[f"train_s/{name}"]
        result[f"logprobs_ratio/{name}"] = result["logprobs_s/rows"] / result[f"logprobs_s/{name}"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
