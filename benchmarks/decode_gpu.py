"""The transformers engine's decode at the whole step's size, with and without its Triton kernels.

    PYTHONPATH=packages/rollout/src:packages/testkit/src:packages/weightsync/src \
        python benchmarks/decode_gpu.py [--modes sdpa,kernels,compiled] [--rounds 3]

A Qwen2.5-1.5B-shaped Qwen2 (random init, the real 151,936-token vocabulary, bf16) generates 8
samples for each of 64 random-token prompts of 16-64 tokens, 512 new tokens each at temperature
1 with EOS ignored: step_gpu.py's rollout, 512 rows x 576 slots. Modes, one engine each, the
same prompts and seed:
  sdpa:      the baseline: attention through sdpa over every slot of the slab, the eager draw
             (the engine before kernels.py);
  kernels:   kernels.decode_attention (each row's slots up to its own) and kernels.draw;
  compiled:  kernels, and compile_decode (the launcher's default).
Per mode: the first call's seconds (capture; compilation when compiled), the median of --rounds
calls, and a decode step's ms with every row at slot 300 (about the call's mean). Last line: one
JSON object, ratio = the first mode's median call seconds / the last mode's.
"""

import argparse
import json
import statistics
import time

import torch

from ferrule_rollout import SamplingSettings, decode
from ferrule_rollout.hf_engine import TransformersEngine
from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model

ROWS, NEW = 512, 512


def timed(call, repeats: int = 1) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (count,), generator=g).tolist()
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def run_mode(mode: str, path, prompts, rounds: int) -> dict:
    patched = {"usable": decode.usable, "triton_available": decode.triton_available}
    if mode == "sdpa":  # the engine as it was: neither kernel
        decode.usable = lambda query, keys: False
        decode.triton_available = lambda: False
    try:
        engine = TransformersEngine(
            path,
            dtype="bfloat16",
            max_batch_size=ROWS,
            max_model_len=NEW + 64,
            compile_decode=mode == "compiled",
        )
        settings = SamplingSettings(n=8, temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=1)
        first = timed(lambda: engine.generate(prompts, settings))
        calls = [timed(lambda: engine.generate(prompts, settings)) for _ in range(rounds)]
        (rows, _), step = next(iter(engine._decoder.steps.items()))
        ids = torch.zeros(rows, dtype=torch.long, device="cuda")
        with torch.inference_mode():
            step.slot.fill_(300)
            step_ms = 1000 * timed(lambda: step.run(ids), 50)
        engine.close()
    finally:
        for name, value in patched.items():
            setattr(decode, name, value)
    torch.cuda.empty_cache()
    return {
        "first_call_s": round(first, 2),
        "call_s": round(statistics.median(calls), 3),
        "calls_s": [round(c, 3) for c in calls],
        "step_ms_at_slot_300": round(step_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="sdpa,kernels,compiled")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = args.modes.split(",")
    path = tiny_model("qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)
    prompts = prompts_of(ROWS // 8)
    results = {}
    for mode in modes:
        results[mode] = run_mode(mode, path, prompts, args.rounds)
        print(mode, results[mode], flush=True)
    ratio = results[modes[0]]["call_s"] / results[modes[-1]]["call_s"]
    print(
        json.dumps(
            {
                "name": "decode_gpu",
                "device": torch.cuda.get_device_name(),
                "rows": ROWS,
                "new_tokens": NEW,
                **results,
                "ratio": round(ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
