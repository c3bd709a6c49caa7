"""What goes into a rollout and what comes out: sampling settings, prompts, samples, errors.

    settings = SamplingSettings(n=4, temperature=1.0, max_tokens=64)   # raises on bad values
    samples = engine.generate(["2 + 2 ="], settings)                    # list[Sample]

Plain data with no vLLM or torch in it, so the gRPC server, the launcher and tests can build and
check these without an engine.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class RolloutError(Exception):
    """Something the caller asked for cannot be done (bad input, wrong state)."""


class BadRequestError(RolloutError, ValueError):
    """The request itself is invalid; the message names the field and the value."""


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample. Defaults are plain ancestral sampling (temperature 1, no truncation)."""

    n: int = 1
    """Samples per prompt (>= 1)."""
    temperature: float = 1.0
    """0 means greedy; otherwise > 0."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) keeps all."""
    max_tokens: int = 16
    """Most new tokens per sample (>= 1); generation also stops at the model's length."""
    stop: tuple[str, ...] = ()
    """Strings that end a sample. The stop string is left out of the sample's text."""
    seed: int | None = None
    """Per-request seed: sample i of a prompt uses seed + i, so the n samples differ."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks use this)."""
    cut_below: int = 0
    """Partial rollouts (the transformers engine only). A value > 0 ends the call once no
    prompt waits and fewer than this many samples still run. Those samples come back unfinished
    (finish_reason "abort"), and a later call can continue them (`Continuation`). 0 lets every
    sample run to its end."""

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n must be >= 1, got {self.n!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k must be >= 1, or 0 / -1 for no limit, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if not isinstance(self.cut_below, int) or self.cut_below < 0:
            problems.append(f"cut_below must be >= 0, got {self.cut_below!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an integer or None, got {self.seed!r}")
        if problems:
            raise BadRequestError("invalid sampling settings: " + "; ".join(problems))


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


# A prompt is text (tokenized once by the engine's tokenizer) or a list of token ids (or, for
# the transformers engine, a `Continuation`, defined below).
Prompt = str | list[int]


def prompt_token_ids(
    prompts: Sequence[Prompt], tokenizer, vocab_size: int, max_model_len: int
) -> list[list[int]]:
    """Return every prompt of a request as token ids (text is encoded with `tokenizer.encode`).
    The prompts are checked before any work starts, and a BadRequestError names the first bad
    prompt. Both engines call this, so they accept and refuse the same requests with the same
    messages."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise BadRequestError("prompts must be a list of strings or of token-id lists")
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence):
            check_prompt_length(index, len(prompt), max_model_len)  # before scanning every id
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequestError(f"prompt {index} must be a string or a list of token ids")
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise BadRequestError(
                    f"prompt {index}: token ids {bad[:5]} are outside the vocabulary "
                    f"[0, {vocab_size})"
                )
        else:
            raise BadRequestError(f"prompt {index} must be a string or a list of token ids")
        if not ids:
            raise BadRequestError(f"prompt {index} is empty")
        check_prompt_length(index, len(ids), max_model_len)
        checked.append(ids)
    return checked


def check_prompt_length(index: int, tokens: int, max_model_len: int) -> None:
    """Raise BadRequestError unless prompt `index`, which is `tokens` long, leaves room for at
    least one generated token."""
    if tokens >= max_model_len:
        raise BadRequestError(
            f"prompt {index} is {tokens} tokens long; the model's maximum length is "
            f"{max_model_len} (prompt plus at least one generated token)"
        )


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens [start, end) were sampled by the weights of policy `version`."""

    version: int
    start: int
    end: int


@dataclass
class Sample:
    """One generated completion."""

    prompt_index: int
    """Which prompt of the request this sample answers."""
    sample_index: int
    """Which of the prompt's n samples this is (0..n-1)."""
    prompt_token_ids: list[int]
    token_ids: list[int]
    """The sampled tokens."""
    logprobs: list[float]
    """Log-probability of each sampled token under the distribution that drew it, from the
    weights that sampled it: softmax(logits / temperature), renormalised over the top-k / top-p
    tokens when those are set (greedy: softmax(logits)). With top-k and top-p off, this is the
    quantity that the trainer's forward pass computes at the same temperature."""
    finish_reason: str
    """"stop" (EOS or a stop string), "length" (max_tokens or the model's length) or "abort"."""
    version: int
    """Policy version of the weights that produced the sample. When an update landed mid-sample
    (pause mode "keep"), this is the oldest version that contributed tokens, and `versions` has
    the details."""
    text: str = ""
    versions: list[VersionSpan] = field(default_factory=list)
    """The version of every stretch of tokens; one span unless an update landed mid-sample."""
    mask: list[int] | None = None
    """Multi-turn episodes only (episodes.py): 1 on the tokens the model sampled, 0 on those an
    environment inserted (no loss, no gradient); None when every token was sampled."""
    turn_rewards: list[tuple[int, float]] | None = None
    """Multi-turn episodes only: the rewards the environment gave before the episode's last
    turn, each as (index of that turn's last token in `token_ids`, reward)."""
    draw_key: int | None = None
    """Set on a cut sample (finish_reason "abort", transformers engine only): the key of the
    sample's random draws. With it, the continuation draws what one uninterrupted call would
    have drawn."""


@dataclass(frozen=True)
class Continuation:
    """A prompt that continues a cut sample (finish_reason "abort") under the engine's current
    weights. The transformers engine only.

    The sample's prompt and tokens so far are prefilled, and at most `max_tokens` minus those
    tokens follow. The returned sample holds all of them (tokens, logprobs, version spans), and
    its `version` stays the oldest one. A Continuation gives one sample, whatever the call's n.
    With `final`, the sample is not cut again in this call (the caller's staleness bound)."""

    sample: Sample
    final: bool = False
