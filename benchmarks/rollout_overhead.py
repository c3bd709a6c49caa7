"""Rollout throughput: ferrule-rollout's engine against bare `vllm.LLM.generate`, same work.

    uv run python benchmarks/rollout_overhead.py [--prompts 32] [--n 2] [--max-tokens 64] [--rounds 7]

Every contender gets the same prompts and sampling settings (temperature 1, fixed seed,
`ignore_eos`, the sampled token's logprob, which RL needs and our engine always returns, prefix
caching on for every vLLM engine) on the tiny kit model:
  ours      VLLMEngine.generate, in this process
  baseline  vllm.LLM.generate, a second in-process engine in this same process
  grpc      a `rlhf-rollout serve` server in its own process, driven by RolloutClient
  hf        transformers `generate` on the same weights, sampling as many tokens
Both vLLM engines live in one process so that they share its memory placement and thread
setup; only one contender runs at a time, in round-robin order that alternates direction, so
that load from other processes on this shared machine hits all alike. Figures are the median
round in output tokens per second; each ratio is the median of the per-round ratios (ours and the
baseline always run back to back). Last line: one JSON object with `ours`, `baseline`, `ratio`
(goal >= 0.95), `grpc_ratio` and `hf_vs_vllm`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GOAL = 0.95


def make_prompts(count: int) -> list[str]:
    return [
        f"Question {i}: what is {i} + {2 * i}? Think step by step. Answer:" for i in range(count)
    ]


def contenders(model: str, prompts: list[str], args) -> tuple[dict, callable]:
    """name -> a function that runs one round and returns the output tokens; and a cleanup."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from ferrule_rollout import SamplingSettings, VLLMEngine
    from ferrule_rollout.client import RolloutClient

    options = dict(
        dtype="float32", max_model_len=256, seed=0, enforce_eager=True, enable_prefix_caching=True
    )
    settings = SamplingSettings(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0
    )
    params = SamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0, logprobs=0
    )

    llm = LLM(model, distributed_executor_backend="uni", **options)
    engine = VLLMEngine(model, **options)

    command = [sys.executable, "-m", "ferrule_rollout", "serve", "--model", model]
    command += ["--bind", "127.0.0.1:0", "--dtype", "float32", "--max-model-len", "256"]
    command += ["--enable-prefix-caching"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in server.stdout:
        if line.startswith("rlhf-rollout: serving"):
            break
    else:
        raise SystemExit("the rollout server did not start")
    client = RolloutClient(line.rsplit(" on ", 1)[1].strip(), timeout=600)

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)

    def hf_round() -> int:
        with torch.no_grad():
            out = hf.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,  # = ignore_eos: as many tokens as vLLM samples
                num_return_sequences=args.n,
                pad_token_id=tokenizer.pad_token_id,
            )
        return (out.shape[1] - batch.input_ids.shape[1]) * out.shape[0]

    rounds = {
        "ours": lambda: sum(len(s.token_ids) for s in engine.generate(prompts, settings)),
        "baseline": lambda: sum(
            len(c.token_ids)
            for out in llm.generate(prompts, params, use_tqdm=False)
            for c in out.outputs
        ),
        "grpc": lambda: sum(len(s.token_ids) for s in client.generate(prompts, settings)),
        "hf": hf_round,
    }

    def cleanup():
        client.close()
        server.terminate()
        server.communicate(timeout=60)
        engine.close()

    return rounds, cleanup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from ferrule_testkit import tiny_model

    rounds, cleanup = contenders(str(tiny_model("qwen2")), make_prompts(args.prompts), args)
    rates = {name: [] for name in rounds}
    try:
        for run in rounds.values():  # warm-up: first-call costs are not throughput
            run()
        order = list(rounds)
        for index in range(args.rounds):
            for name in order if index % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                tokens = rounds[name]()
                rates[name].append(tokens / (time.perf_counter() - start))
            print(
                f"round {index + 1}: "
                + ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in rates.items()),
                file=sys.stderr,
            )
    finally:
        cleanup()

    def ratio(name: str) -> float:
        pairs = zip(rates[name], rates["baseline"], strict=True)
        return round(statistics.median(a / b for a, b in pairs), 3)

    median = {name: round(statistics.median(values), 1) for name, values in rates.items()}
    print(
        json.dumps(
            {
                "name": "rollout_overhead",
                "unit": "output tokens/s (median round); ratios: median of per-round ratios",
                "ours": median["ours"],
                "baseline": median["baseline"],
                "ratio": ratio("ours"),
                "goal": GOAL,
                "grpc": median["grpc"],
                "grpc_ratio": ratio("grpc"),
                "hf": median["hf"],
                "hf_vs_vllm": ratio("hf"),
                "prompts": args.prompts,
                "n": args.n,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "model": "testkit tiny qwen2 (float32, CPU)",
            }
        )
    )


if __name__ == "__main__":
    main()
