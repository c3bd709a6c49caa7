"""Multi-turn rollout: ferrule-rollout's episode runner against the same episodes run one turn
at a time through the engine's plain `generate` from a Python loop.

    uv run python benchmarks/episodes.py [--episodes 64] [--turns 3] [--max-tokens 16]
                                         [--step-ms 20] [--rounds 5]

Both sides use one VLLMEngine (vLLM on CPU, the tiny kit model) and the same environment: each
episode answers every model turn with a short observation after `step_ms` milliseconds on
average (uniform in [0, 2 x step_ms]: a tool call, a sandbox, a lookup), until `turns` model
turns are done. Sampling: temperature 1, `max_tokens` per turn, end-of-sequence ignored, so both
sides generate the same number of tokens.
  ours      episodes.run_episodes: every episode at once; a turn goes to the engine as soon as
            its observation is back, environment steps run in their own threads
  baseline  per turn: one `engine.generate` over every episode's history (token ids), then
            each episode's environment step in turn, from a plain Python loop
Rounds alternate ours / baseline; the figures are median episodes per second. The run is done
twice: with the environment's latency and with none (`ratio_no_latency`: the engine side
alone). Last line: one JSON object ending with `ratio` (ours / baseline with latency; goal >= 2).
"""

import argparse
import json
import random
import statistics
import time

from ferrule_rollout.environments import Environment, StepResult

GOAL = 2.0


class Timed(Environment):
    """Answers each turn after a random delay; done after `turns` model turns."""

    def __init__(self, turns: int, step_ms: float, seed: int):
        self.turns, self.step_ms, self.rng = turns, step_ms, random.Random(seed)

    def reset(self, prompt, label, metadata):
        self.done = 0
        return prompt

    def step(self, model_output):
        time.sleep(self.rng.uniform(0, 2 * self.step_ms) / 1000)
        self.done += 1
        if self.done >= self.turns:
            return StepResult(None, 1.0)
        return StepResult(f" Observation {self.done}: noted. Next:", 0.0)


def baseline(engine, prompts, settings, args, step_ms) -> int:
    """The same episodes, one turn at a time; returns the model tokens generated."""
    tokenizer = engine.tokenizer
    envs = [Timed(args.turns, step_ms, seed=i) for i in range(len(prompts))]
    histories = [
        tokenizer.encode(env.reset(p, "", {})) for env, p in zip(envs, prompts, strict=True)
    ]
    active, tokens = list(range(len(prompts))), 0
    while active:
        samples = engine.generate([histories[i] for i in active], settings)
        still = []
        for i, sample in zip(active, samples, strict=True):
            histories[i] += sample.token_ids
            tokens += len(sample.token_ids)
            observation = envs[i].step(tokenizer.decode(sample.token_ids)).observation
            if observation is not None:
                histories[i] += tokenizer.encode(observation, add_special_tokens=False)
                still.append(i)
        active = still
    return tokens


def ours(engine, prompts, settings, args, step_ms) -> int:
    from ferrule_rollout.environments import EpisodeBudget
    from ferrule_rollout.episodes import run_episodes

    seeds = iter(range(len(prompts)))

    class Env(Timed):
        def __init__(self):
            super().__init__(args.turns, step_ms, seed=next(seeds))

    budget = EpisodeBudget(max_turns=args.turns, max_tokens=10_000)
    episodes = run_episodes(engine, Env, prompts, settings, budget=budget)
    assert all(e.failure is None and e.turns == args.turns for e in episodes), episodes[0]
    return sum(sum(e.mask) for e in episodes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from ferrule_rollout import SamplingSettings, VLLMEngine
    from ferrule_testkit import tiny_model

    engine = VLLMEngine(
        tiny_model("qwen2"),
        dtype="float32",
        max_model_len=512,
        seed=0,
        enforce_eager=True,
        gpu_memory_utilization=0.3,  # on CPU: the share of host memory for the KV cache
    )
    settings = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [f"Task {i}: look things up, then answer." for i in range(args.episodes)]
    result = {"name": "episodes", "episodes": args.episodes, "turns": args.turns}
    for label, step_ms in (("no_latency", 0.0), ("latency", args.step_ms)):
        rates = {"ours": [], "baseline": []}
        tokens = {}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            order = [ours, baseline] if round_ % 2 else [baseline, ours]
            for run in order:
                start = time.perf_counter()
                tokens[run.__name__] = run(engine, prompts, settings, args, step_ms)
                if round_:
                    rates[run.__name__].append(args.episodes / (time.perf_counter() - start))
        assert tokens["ours"] == tokens["baseline"], tokens  # the same work
        figures = {name: statistics.median(r) for name, r in rates.items()}
        result[f"{label}_episodes_per_s"] = {k: round(v, 2) for k, v in figures.items()}
        result[f"ratio_{label}"] = round(figures["ours"] / figures["baseline"], 3)
    engine.close()
    result["step_ms"] = args.step_ms
    result["goal"] = GOAL
    result["ratio"] = result.pop("ratio_latency")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
