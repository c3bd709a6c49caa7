"""Trainer throughput on one GPU: our DeepSpeed ZeRO-2 bf16 step against a plain torch loop.

    TORCH_CUDA_ARCH_LIST=9.0 python benchmarks/trainer_gpu.py [--steps 20] [--batch 8] [--seq 1024]

A Qwen2 model of Qwen2.5-0.5B's shape (random initialisation, built from a config: no hub)
trains on random tokens, the same batches for both:
  ours:      ferrule_trainer.engine (DeepSpeed ZeRO-2, bf16 weights, fp32 master weights in the
             ZeRO optimizer, fused Adam, gradient clipping) with the SFT loss of sft.py;
  baseline:  plain torch with the same numerics: fp32 weights, bf16 autocast, the same loss,
             clip_grad_norm_, torch.optim.AdamW(fused=True).
Figures are training tokens per second over --steps timed steps after --warmup steps; MFU counts
6 N + 12 L d T FLOPs per token (PaLM's formula) against the GPU's dense bf16 peak. Needs torch,
deepspeed and transformers only: ferrule_trainer is imported from this source tree. The last line
is one JSON object; ratio = ours / baseline (higher is better).
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

# DeepSpeed's op builder fails on the image's "9.0a" (ENVIRONMENT.md); set before it is imported.
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "trainer" / "src"))

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from ferrule_trainer import engine
from ferrule_trainer.batch import SequenceBatch
from ferrule_trainer.sft import sft_loss

# dense bf16 peak, TFLOP/s, by device name
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def qwen2_05b_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_cache=False,
    )


def build_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        qwen2_05b_config(), dtype=dtype, attn_implementation="sdpa"
    )
    return model.cuda()


def batches(args) -> list[SequenceBatch]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, 151936, (args.batch, args.seq), generator=generator).cuda()
        ones = torch.ones_like(ids)
        out.append(SequenceBatch(ids, ones, ones))
    return out


def tokens_of(batch) -> torch.Tensor:
    return batch.loss_mask[:, 1:].sum().double()


def timed(step, data, warmup: int) -> float:
    for batch in data[:warmup]:
        step(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in data[warmup:]:
        step(batch)
    torch.cuda.synchronize()
    tokens = sum(b.input_ids.numel() for b in data[warmup:])
    return tokens / (time.perf_counter() - start)


def run_baseline(args, data) -> float:
    model = build_model(torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=True)

    def step(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = sft_loss(model, batch, tokens_of(batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, data, args.warmup)


def run_ours(args, data) -> float:
    engine.init_distributed()
    model = build_model(torch.bfloat16)
    config = engine.deepspeed_config(zero_stage=2, dtype="bfloat16")
    config["zero_optimization"].update(args.zero)
    ds_engine = engine.build_engine(model, learning_rate=1e-5, ds_config=config)

    def step(batch):
        count = tokens_of(batch)
        engine.optimizer_step(ds_engine, [batch], lambda mb: (sft_loss(ds_engine, mb, count), {}))

    return timed(step, data, args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument(
        "--zero",
        type=json.loads,
        default={},
        help="extra zero_optimization settings to try, JSON: '{\"overlap_comm\": true}'",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("trainer_gpu.py needs a CUDA GPU")

    data = batches(args)
    baseline = run_baseline(args, data)
    gc.collect()  # the baseline's model and optimizer are garbage once it returns
    torch.cuda.empty_cache()
    ours = run_ours(args, data)

    config = qwen2_05b_config()
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    flops_per_token = 6 * params + 12 * config.num_hidden_layers * config.hidden_size * args.seq
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    mfu = (
        (lambda speed: round(speed * flops_per_token / (peak * 1e12), 4))
        if peak
        else (lambda s: None)
    )
    print(
        f"{name}: ours {ours:.0f} tokens/s (MFU {mfu(ours)}), baseline {baseline:.0f} (MFU {mfu(baseline)})"
    )
    result = {
        "name": "trainer_gpu_zero2_bf16_qwen2_0.5b",
        "ours": round(ours, 1),
        "baseline": round(baseline, 1),
        "ratio": round(ours / baseline, 4),
        "goal": ">= 0.9",
        "unit": "training tokens/s",
        "mfu_ours": mfu(ours),
        "mfu_baseline": mfu(baseline),
        "params": params,
        "batch": [args.batch, args.seq],
        "device": name,
        "zero_overrides": args.zero,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
