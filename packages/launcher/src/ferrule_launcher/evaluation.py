"""What a held-out evaluation reports: mean reward, pass@1 and pass@k, per source and overall;
and what its generation cost.

    groups = [[0.0, 1.0, 1.0, 0.5], ...]        # the n rewards of each held-out prompt
    report = summarize(groups, ["gsm8k", ...], k=4, threshold=1.0)
    # {"reward": 0.62, "pass@1": 0.5, "pass@4": 0.75, "gsm8k/reward": ..., ...}

A sample succeeds when its reward reaches `threshold` (within a rounding error: a reward of
0.7 - 0.4 reaches a threshold of 0.3). pass@k is the unbiased estimator of Chen et al. (2021).
For a prompt with c successes among n samples, it is the chance that k samples drawn without
replacement from the n include at least one success: 1 - C(n-c, k) / C(n, k). The report
averages it over prompts.
"""

from collections import defaultdict

from ferrule_trainer.recipes import reaches as succeeded  # the recipes' reward floor uses it too


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` successes in `n` samples (k <= n). It is
    computed as a product, not as a ratio of binomials, because those overflow floats for
    large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a success
        return 1.0
    failing = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod (1 - k / i)
        failing *= 1.0 - k / i
    return 1.0 - failing


def summarize(groups: list[list[float]], sources: list[str], k: int, threshold: float) -> dict:
    """Mean reward, pass@1 and pass@k over every prompt, and the same under "<source>/" for
    each source when there is more than one."""
    if len(groups) != len(sources):
        raise ValueError(f"{len(groups)} prompt groups but {len(sources)} sources")
    if not groups:
        raise ValueError("nothing to evaluate: no held-out prompts")
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for group, source in zip(groups, sources, strict=True):
        by_source[source].append(group)
    report = _figures(groups, k, threshold)
    if len(by_source) > 1:
        for source, its_groups in sorted(by_source.items()):
            report.update(
                {f"{source}/{key}": v for key, v in _figures(its_groups, k, threshold).items()}
            )
    return report


def _figures(groups: list[list[float]], k: int, threshold: float) -> dict:
    rewards = [reward for group in groups for reward in group]
    figures = {"reward": sum(rewards) / len(rewards)}
    for kk in sorted({1, k}):
        per_prompt = [
            pass_at_k(len(g), sum(succeeded(r, threshold) for r in g), kk) for g in groups
        ]
        figures[f"pass@{kk}"] = sum(per_prompt) / len(per_prompt)
    return figures


def generation(calls: list[tuple[list, float]]) -> dict:
    """What an evaluation's generation cost, over its calls' (samples, seconds): the tokens,
    their rate, the mean and the longest response and the share cut at max_tokens. The longest
    response sets how many decode steps a call takes, so it explains a slow evaluation (a
    random model's greedy responses run to the cap). An episode counts its whole transcript,
    the environment's tokens included."""
    samples = [sample for each, _ in calls for sample in each]
    tokens = [len(s.token_ids) for s in samples]
    seconds = sum(seconds for _, seconds in calls)
    return {
        "generation/tokens": sum(tokens),
        "generation/seconds": seconds,
        "generation/tokens_per_s": sum(tokens) / max(seconds, 1e-9),
        "generation/response_length": sum(tokens) / max(len(tokens), 1),
        "generation/response_length/max": max(tokens, default=0),
        "generation/truncated": sum(s.finish_reason == "length" for s in samples)
        / max(len(samples), 1),
    }
