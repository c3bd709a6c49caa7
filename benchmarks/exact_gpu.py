"""Exact mode at a real size on one GPU: its throughput cost, and its logprobs against the
trainer's.

    PYTHONPATH=packages/rollout/src:packages/trainer/src:packages/testkit/src:\
packages/weightsync/src python benchmarks/exact_gpu.py [--rounds 3] [--prompts 32] [--n 8]

A Qwen2.5-1.5B-shaped Qwen2 (random init, the real 151,936-token vocabulary) in bf16 generates
`--n` samples for each of `--prompts` random prompts, `--new-tokens` tokens each at temperature 1
with EOS ignored, with the transformers engine twice in the same run:
  ours:      TransformersEngine(exact=True) (exact.py's batch-invariant numerics);
  baseline:  TransformersEngine() (the default: CUDA graphs, sdpa).
Tokens/s are medians of --rounds timed rounds after one warm-up. Then each engine's sampled
logprobs against the trainer's teacher-forced forward of the same bf16 weights
(ferrule_trainer's `rl.build_batch` layout and `sequences.response_logits` + `token_logprobs`,
over micro-batches of --micro-batch rows;
for exact mode the trainer's model has the same ExactNumerics applied): tokens whose logprobs
are equal bit for bit, max |difference| and vllm_kl (the launcher's k3 estimate per token).
Last line: one JSON object, ratio = ours / baseline tokens/s (goal: >= 0.7, a cost <= 30%).
"""

import argparse
import json
import statistics

import torch
from rollout_gpu import prompts_of, timed
from transformers import AutoModelForCausalLM

from ferrule_rollout import SamplingSettings
from ferrule_rollout.exact import ExactNumerics
from ferrule_rollout.hf_engine import TransformersEngine
from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model
from ferrule_trainer.rl import build_batch
from ferrule_trainer.sequences import response_logits, token_logprobs


def tokens_per_s(engine, prompts, n, tokens, rounds) -> float:
    settings = SamplingSettings(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, settings)  # warm-up: graphs captured
    times = [timed(lambda: engine.generate(prompts, settings)) for _ in range(rounds)]
    return len(prompts) * n * tokens / statistics.median(times)


def trainer_logprobs(model, samples, micro_batch: int) -> list[torch.Tensor]:
    """The trainer's logprobs of each sample's tokens: its batch layout (`rl.build_batch`) and
    its forward (`response_logits` + `token_logprobs`), `micro_batch` rows at a time."""
    out = []
    for start in range(0, len(samples), micro_batch):
        part = samples[start : start + micro_batch]
        batch = build_batch(part, pad_id=0).to("cuda")
        with torch.no_grad():
            logprobs = token_logprobs(response_logits(model, batch), batch.response_tokens)
        out += [logprobs[r, : len(s.token_ids)].cpu() for r, s in enumerate(part)]
    return out


def agreement(engine, model, prompts, n, tokens, micro_batch) -> dict:
    settings = SamplingSettings(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
    samples = engine.generate(prompts, settings)
    theirs = trainer_logprobs(model, samples, micro_batch)
    ours = [torch.tensor(s.logprobs) for s in samples]
    engine_lp, trainer_lp = torch.cat(ours), torch.cat(theirs)
    log_ratio = trainer_lp - engine_lp
    return {
        "tokens": len(engine_lp),
        "bit_equal_share": round((engine_lp == trainer_lp).float().mean().item(), 6),
        "max_abs_diff": (engine_lp - trainer_lp).abs().max().item(),
        "vllm_kl": (log_ratio.exp() - 1 - log_ratio).mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    path = tiny_model("qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)
    prompts = prompts_of(args.prompts)
    result = {"name": "exact_gpu", "device": torch.cuda.get_device_name()}
    common = dict(dtype="bfloat16", max_model_len=args.max_model_len)
    for label, exact in (("baseline", False), ("ours", True)):
        engine = TransformersEngine(path, exact=exact, **common)
        result[label] = round(tokens_per_s(engine, prompts, args.n, args.new_tokens, args.rounds))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        if exact:
            ExactNumerics(engine.max_model_len).apply(model)
        result[f"{label}_agreement"] = agreement(
            engine, model, prompts[:8], 4, args.new_tokens, args.micro_batch
        )
        result[f"{label}_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
        engine.close()
        del engine, model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    result["goal"] = ">= 0.7 (exact costs <= 30%), bit_equal_share 1.0"
    result["ratio"] = round(result["ours"] / result["baseline"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
