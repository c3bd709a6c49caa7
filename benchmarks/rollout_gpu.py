"""The transformers rollout engine at a real size on one GPU, against Hugging Face `generate`.

    PYTHONPATH=packages/rollout/src:packages/testkit/src:packages/weightsync/src \
        python benchmarks/rollout_gpu.py [--rounds 3] [--prompts 32] [--n 8] [--new-tokens 256]
        [--compile] [--agreement] [--old-engine old_hf_engine.py] [--no-layout]
        [--step-batches 64,256,1024]

A Qwen2.5-1.5B-shaped Qwen2 (ferrule_testkit.tiny_model: random init, the real 151,936-token
vocabulary, the kit's small tokenizer) in bf16 generates `--n` samples for each of `--prompts`
random-token prompts, `--new-tokens` tokens each at temperature 1 with EOS ignored:
  ours:      TransformersEngine.generate (decode.py's loop);
  baseline:  the same model's `model.generate`, the same rows left-padded, do_sample, top_k 0,
             top_p 1, min_new_tokens = max_new_tokens (so both sides make the same count).
Tokens/s are medians of --rounds timed rounds after one warm-up. Also: ms per decode step at
batch 64 / 256 / 1024 for both ((time of T tokens - time of 1) / (T - 1)), peak GPU memory, the
share of the HBM bound (weights + the KV actually attended, read once per step), our step split
into the graphed forward and the sampling, the step with the parameters in one allocation (the
engine's) against one allocation each and back (A, B, A), the launcher's evaluation (16 prompts x
256 tokens, greedy), with --old-engine an older hf_engine.py's step at 256 rows, and with
--agreement our logprobs against HF's teacher-forced bf16 forward (vllm_kl, the launcher's k3
estimate). --compile: ours with compile_decode=True. Last line: one JSON object, ratio = ours / baseline.
"""

import argparse
import importlib.util
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from ferrule_rollout import SamplingSettings
from ferrule_rollout.hf_engine import TransformersEngine
from ferrule_rollout.sampling import sample
from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model

HBM_TB_S = {"H100": 3.35, "H200": 4.8}  # SXM datasheet bandwidth


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 16-64 tokens from the kit tokenizer's ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (count,), generator=g).tolist()
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def timed(call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ours(engine, prompts, n: int, tokens: int):
    settings = SamplingSettings(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True)
    samples = engine.generate(prompts, settings)
    assert all(len(s.token_ids) == tokens for s in samples)
    return samples


def hf_generate(model, prompts, n: int, tokens: int, pad: int):
    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(rows):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    out = model.generate(
        input_ids=ids.cuda(),
        attention_mask=mask.cuda(),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=pad,
    )
    assert out.shape[1] == width + tokens


def step_ms(call, rows: int, tokens: int) -> float:
    """ms per decode step at `rows` rows: (T tokens - 1 token) / (T - 1)."""
    prompts = prompts_of(rows, seed=rows)
    call(prompts, 1)  # warm-up (and graph capture) at this shape
    call(prompts, tokens)
    first = timed(lambda: call(prompts, 1))
    full = timed(lambda: call(prompts, tokens))
    return 1000 * (full - first) / (tokens - 1)


def split_step(engine, rows: int, repeats: int = 50) -> dict:
    """Our step at `rows` rows (after a call of that shape): the graphed forward, the sampling."""
    shapes = list(engine._decoder.steps)
    step = next((s for (b, _), s in engine._decoder.steps.items() if b == rows), None)
    if step is None or step.graph is None:
        return {"missing": str(shapes)}
    ids = torch.zeros(rows, dtype=torch.long, device="cuda")
    u = torch.rand(rows, dtype=torch.float64, device="cuda")
    with torch.inference_mode():  # as the engine runs them, from slot 0 (past the end: a fault)
        step.slot.zero_()
        replay = timed(lambda: [step.run(ids) for _ in range(repeats)])
        sampling = timed(lambda: [sample(step.logits, 1.0, 0, 1.0, u) for _ in range(repeats)])
    return {
        "forward_ms": round(1000 * replay / repeats, 2),
        "sample_ms": round(1000 * sampling / repeats, 2),
    }


def separate_allocations(engine) -> None:
    """Each parameter in an allocation of its own (as from_pretrained leaves them)."""
    for param in engine._model.parameters():
        param.data = param.data.clone()
    engine._decoder = None


def agreement(engine, hf, prompts, tokens: int) -> dict:
    """Our sampled tokens' logprobs against HF's teacher-forced bf16 forward of the same weights
    (what the trainer computes): |difference| max / mean and the launcher's vllm_kl (the k3
    estimate of KL(engine || trainer) per token)."""
    settings = SamplingSettings(n=2, max_tokens=tokens, ignore_eos=True, seed=0)
    differences = []
    for drawn in engine.generate(prompts[:8], settings):
        ids = torch.tensor([drawn.prompt_token_ids + drawn.token_ids], device="cuda")
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(drawn.prompt_token_ids) - 1 : -1].float()
        chosen = torch.tensor(drawn.token_ids, device="cuda")[:, None]
        trainer = torch.log_softmax(logits, -1).gather(1, chosen)[:, 0]
        differences.append(trainer - torch.tensor(drawn.logprobs, device="cuda"))
    r = torch.cat(differences).double()
    return {
        "tokens": r.numel(),
        "max_abs": round(float(r.abs().max()), 5),
        "mean_abs": round(float(r.abs().mean()), 6),
        "vllm_kl_k3": float(f"{float((r.exp() - 1 - r).mean()):.3g}"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--step-tokens", type=int, default=64, help="tokens per step timing")
    parser.add_argument("--step-batches", default="64,256,1024")
    parser.add_argument("--no-layout", action="store_true", help="skip the layout comparison")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="ours with TransformersEngine(compile_decode=True)",
    )
    parser.add_argument(
        "--agreement", action="store_true", help="our logprobs against a teacher-forced forward"
    )
    parser.add_argument(
        "--old-engine", help="an older hf_engine.py (git show REV:path > file): its step at 256"
    )
    args = parser.parse_args()

    began = time.perf_counter()
    path = tiny_model("qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)
    built = time.perf_counter() - began
    batches = [int(b) for b in args.step_batches.split(",") if b]
    rows, tokens = args.prompts * args.n, args.new_tokens
    engine = TransformersEngine(
        path,
        dtype="bfloat16",
        max_model_len=2048,
        max_batch_size=max([*batches, rows]),
        compile_decode=args.compile,
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    pad = engine._pad
    prompts = prompts_of(args.prompts)

    def run_ours():
        ours(engine, prompts, args.n, tokens)

    def run_hf():
        with torch.inference_mode():
            hf_generate(hf, prompts, args.n, tokens, pad)

    torch.cuda.reset_peak_memory_stats()
    warmup_s = timed(run_ours)  # captures (and with --compile compiles) this shape's step
    ours_s = [timed(run_ours) for _ in range(args.rounds)]
    peak_ours = torch.cuda.max_memory_allocated() / 1e9
    hf_generate(hf, prompts, args.n, 64, pad)  # warm-up
    base_s = [timed(run_hf) for _ in range(args.rounds)]
    ours_tps = rows * tokens / statistics.median(ours_s)
    base_tps = rows * tokens / statistics.median(base_s)
    print(f"ours {ours_s} s, HF generate {base_s} s", flush=True)
    split = split_step(engine, rows)
    print(f"split {split}", flush=True)

    steps = {}
    for b in batches:
        mine = step_ms(lambda p, t: ours(engine, p, 1, t), b, args.step_tokens)
        theirs = step_ms(
            lambda p, t: hf_generate(hf, p, 1, t, pad), b, max(8, args.step_tokens // 4)
        )
        steps[b] = {"ours_ms": round(mine, 2), "hf_ms": round(theirs, 2)}
        print(f"batch {b}: ours {mine:.2f} ms/step, HF generate {theirs:.2f} ms/step", flush=True)

    layout = None
    if not args.no_layout:
        one = step_ms(lambda p, t: ours(engine, p, 1, t), 256, args.step_tokens)
        separate_allocations(engine)
        apart = step_ms(lambda p, t: ours(engine, p, 1, t), 256, args.step_tokens)
        engine._lay_out_parameters()  # back in one allocation: A, B, A against drift
        again = step_ms(lambda p, t: ours(engine, p, 1, t), 256, args.step_tokens)
        layout = {
            "one_allocation_ms": round(one, 2),
            "separate_ms": round(apart, 2),
            "one_allocation_again_ms": round(again, 2),
        }

    # The launcher's held-out evaluation: 16 prompts x 1 sample x 256 tokens, greedy.
    evaluation = prompts_of(16, seed=16)
    greedy = SamplingSettings(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate(evaluation, greedy)
    eval_ours = timed(lambda: engine.generate(evaluation, greedy))
    eval_hf = timed(lambda: hf_generate(hf, evaluation, 1, tokens, pad))
    print(f"evaluation 16 x {tokens}: ours {eval_ours:.2f} s, HF {eval_hf:.2f} s", flush=True)

    agreed = agreement(engine, hf, prompts, tokens) if args.agreement else None
    print(f"agreement {agreed}", flush=True)
    old = None
    if args.old_engine:  # its own copy of the weights; ours and HF's stay where they are
        spec = importlib.util.spec_from_file_location("old_hf_engine", args.old_engine)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with module.TransformersEngine(path, dtype="bfloat16", max_model_len=2048) as previous:
            old = round(step_ms(lambda p, t: ours(previous, p, 1, t), 256, 16), 2)

    name = torch.cuda.get_device_name()
    bandwidth = next((v for k, v in HBM_TB_S.items() if k in name), 3.35) * 1e12
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    config = hf.config
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 128 * 2
    context = statistics.mean(map(len, prompts)) + tokens / 2  # attended, on average
    bound_ms = 1000 * (weights + rows * context * kv_per_token) / bandwidth
    measured_ms = 1000 * statistics.median(ours_s) / tokens
    result = {
        "name": "rollout_gpu",
        "device": name,
        "ours": round(ours_tps),
        "baseline": round(base_tps),
        "ratio": round(ours_tps / base_tps, 3),
        "goal": "ratio >= 3 (stretch 5); decode step <= 10 ms at batch 256",
        "unit": f"tokens/s, {rows} rows x {tokens} new tokens",
        "ours_s": [round(s, 3) for s in ours_s],
        "baseline_s": [round(s, 3) for s in base_s],
        "step_ms": steps,
        "ours_step_ms_in_run": round(measured_ms, 2),
        "hbm_bound_ms": round(bound_ms, 2),
        "hbm_share": round(bound_ms / measured_ms, 3),
        "split_at_rows": {"rows": rows, **split},
        "layout_at_256": layout,
        "old_engine_step_ms_at_256": old,
        "logprobs_vs_teacher_forced_bf16": agreed,
        "eval_16x256_s": {"ours": round(eval_ours, 2), "hf_sampled": round(eval_hf, 2)},
        "peak_gb_ours_both_models_resident": round(peak_ours, 1),
        "build_s": round(built, 1),
        "compile_decode": args.compile,
        "ours_first_call_s": round(warmup_s, 1),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
