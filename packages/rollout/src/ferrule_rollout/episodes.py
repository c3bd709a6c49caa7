"""The multi-turn runner: many episodes of one Environment at once on a rollout engine.

    episodes = run_episodes(engine, "my_envs.py:Guess", prompts, SamplingSettings(max_tokens=64),
                            budget=EpisodeBudget(max_turns=4, max_tokens=512))
    e = episodes[0]; e.prompt_ids, e.response_ids, e.mask, e.logprobs, e.rewards, e.failure
    check_failures(episodes, "my_envs.py:Guess", max_failed_fraction=0.1)   # raises past it

Each turn sends the episode's whole history as token ids: the first observation's ids, the
model's tokens exactly as generated (never decoded and re-encoded), and each later observation
tokenized on its own. `mask` is 1 on the model's tokens and 0 on the environment's.

One thread (the caller's) drives every episode as a small state machine. Environment calls run
in their own daemon threads with a deadline. A step that hangs fails its episode ("env_timeout")
and is abandoned, never joined. Turns waiting for the model are sent together as one generate
call. An engine that batches across calls (VLLMEngine, where one step loop serves every caller)
gets a new call as soon as turns are waiting. Its samples come back as they finish, so a long
generation or a slow environment holds up only its own episode. The transformers engine runs
calls one at a time, so with it, turns wait for the running call and then go as one batch.
"""

import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ferrule_rollout.environments import (
    FAILURE_REASONS,
    Environment,
    EpisodeBudget,
    EpisodeFailure,
    Observation,
    check_observation,
    check_step_result,
    environment_name,
    load_environment,
)
from ferrule_rollout.interface import Engine
from ferrule_rollout.samples import BadRequestError, RolloutError, Sample, SamplingSettings

_SENTINEL = "FERRULE_ASSISTANT_TURN"  # stands for the model's text when rendering templates
GATHER = 64  # this many waiting turns make a generate call before the event queue drains


@dataclass
class Episode:
    """One finished episode. `mask`, `logprobs` and `versions` are aligned with `response_ids`."""

    index: int
    """Position of the episode's prompt in the call's `prompts`."""
    prompt_ids: list[int]
    """The first observation's tokens."""
    response_ids: list[int] = field(default_factory=list)
    """Everything after the first observation: model turns and observations, in order."""
    mask: list[int] = field(default_factory=list)
    """1 on the model's tokens (trained on), 0 on the environment's (no loss, no gradient)."""
    logprobs: list[float] = field(default_factory=list)
    """The sampling logprob of each model token (see Sample.logprobs); 0.0 on env tokens."""
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each model token; -1 on env tokens."""
    rewards: list[float] = field(default_factory=list)
    """The environment's reward for each model turn (one per step call that returned)."""
    turn_ends: list[int] = field(default_factory=list)
    """For each model turn, the index of its last token in `response_ids`."""
    infos: list[dict] = field(default_factory=list)
    """The environment's info for each step."""
    turns: int = 0
    """Model turns taken."""
    finish_reason: str = ""
    """"done" (the environment ended it), "max_turns", "max_tokens" (the budget or the model's
    length) or "failed"."""
    failure: str | None = None
    """One of FAILURE_REASONS when the episode failed, else None."""
    detail: str = ""
    """What went wrong, for logs (the exception's type and message)."""
    text: str = ""
    """The transcript after the first observation (`response_ids` decoded, special tokens
    skipped): what a reward server scores as the episode's response."""

    @property
    def reward(self) -> float:
        return sum(self.rewards)

    def sample(self) -> Sample:
        """Return the episode as one Sample for scoring and training. The whole transcript after
        the first observation is the sample's response (`text` is decoded from it), and `mask`
        says which tokens the model sampled. `version` is the oldest policy version among those
        tokens. `turn_rewards` holds the rewards of the turns before the last, each at its
        turn's last token (for the estimators with per-token rewards)."""
        model_versions = [v for v in self.versions if v >= 0]
        return Sample(
            prompt_index=self.index,
            sample_index=0,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.response_ids),
            logprobs=list(self.logprobs),
            finish_reason="length" if self.finish_reason == "max_tokens" else "stop",
            version=min(model_versions, default=0),
            text=self.text,
            mask=list(self.mask),
            # every reward except the last turn's, which the score carries
            turn_rewards=list(zip(self.turn_ends, self.rewards[:-1], strict=False)),
        )


@dataclass
class _State:
    """An episode in progress: its environment, history and the call it waits for."""

    episode: Episode
    ids: list[int] = field(default_factory=list)  # the whole history, prompt included
    env: Environment | None = None
    call: int = 0  # the number of the environment call whose answer the episode waits for
    deadline: float | None = None  # when that call times out
    last_eos: bool = False  # the last model turn ended on an end-of-sequence token
    done: bool = False


def run_episodes(
    engine: Engine,
    environment: type[Environment] | str,
    prompts: Sequence,
    settings: SamplingSettings | None = None,
    *,
    labels: Sequence[str] | None = None,
    metadata: Sequence[Mapping] | None = None,
    budget: EpisodeBudget | None = None,
    options: Mapping | None = None,
    tokenizer=None,
    step_timeout: float = 60.0,
    max_calls_in_flight: int | None = None,
) -> list[Episode]:
    """Run one episode per prompt (repeat a prompt for several) and return them in order.

    `engine`: anything with `generate(prompts, settings)` that takes token-id prompts
        (`generate_stream` is used when present): VLLMEngine, TransformersEngine, RolloutClient.
    `environment`: a class, or a `module:Class` / `file.py:Class` spec. It is instantiated once
        per episode as `environment(**options)`.
    `settings`: each turn's sampling. n must be 1 and seed None: one call serves many episodes,
        so a seed would repeat across them. A turn's max_tokens is also cut to what the budget
        and the model's length leave.
    `tokenizer`: the engine's by default.
    `step_timeout`: seconds for each reset / step.
    `max_calls_in_flight`: generate calls at once (default: unlimited where
        `engine.continuous_batching`, else 1).
    """
    env_class = load_environment(environment) if isinstance(environment, str) else environment
    settings = settings or SamplingSettings()
    if settings.n != 1 or settings.seed is not None:
        raise BadRequestError(
            f"run_episodes samples one continuation per episode and turn: settings need n=1 and "
            f"seed=None, got n={settings.n}, seed={settings.seed}"
        )
    budget = budget or EpisodeBudget()
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    labels = list(labels) if labels is not None else [""] * len(prompts)
    metadata = list(metadata) if metadata is not None else [{}] * len(prompts)
    if not len(labels) == len(metadata) == len(prompts):
        raise BadRequestError(
            f"{len(prompts)} prompts, {len(labels)} labels and {len(metadata)} metadata: "
            "give one of each per episode"
        )
    if max_calls_in_flight is None:
        max_calls_in_flight = 1_000_000 if getattr(engine, "continuous_batching", False) else 1
    settings = replace(settings, stop=tuple(settings.stop) + tuple(env_class.stop))
    runner = _Runner(engine, tokenizer, settings, budget, step_timeout, max_calls_in_flight)
    options = dict(options or {})
    return runner.run(
        [
            lambda p=p, lab=lab, meta=meta: _start(env_class, options, p, lab, meta)
            for p, lab, meta in zip(prompts, labels, metadata, strict=True)
        ]
    )


def _start(env_class, options, prompt, label, metadata):
    env = env_class(**options)
    return env, env.reset(prompt, label, metadata)


class _Runner:
    def __init__(self, engine, tokenizer, settings, budget, step_timeout, max_calls):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.budget, self.step_timeout, self.max_calls = budget, step_timeout, max_calls
        self.max_model_len = getattr(engine, "max_model_len", None) or 1 << 62
        self.events: queue.Queue = queue.Queue()
        self.eos = _eos_ids(tokenizer)

    def run(self, starts) -> list[Episode]:
        states = [_State(Episode(index=i, prompt_ids=[])) for i in range(len(starts))]
        for state, start in zip(states, starts, strict=True):
            self._call_env(state, "reset", start)
        waiting: list[_State] = []  # turns ready for the model
        in_flight, active = 0, len(states)
        while active:
            # Turns that become ready together go as one call, so handle every event already
            # queued before sending. A steady stream of events still sends once GATHER turns
            # wait.
            if self.events.empty() or len(waiting) >= GATHER:
                while waiting and in_flight < self.max_calls:
                    in_flight += self._dispatch(waiting)
            first = min((s.deadline for s in states if s.deadline and not s.done), default=None)
            if first is not None and first <= time.monotonic():  # even while events keep coming
                for state in states:
                    if not state.done and state.deadline and state.deadline <= time.monotonic():
                        self._fail(state, "env_timeout", f"no answer in {self.step_timeout:g}s")
                        active -= 1
                continue
            try:
                event = self.events.get(
                    timeout=None if first is None else max(0, first - time.monotonic())
                )
            except queue.Empty:
                continue
            kind, state, *payload = event
            if kind == "call_done":
                in_flight -= 1
                continue
            if kind == "engine_error":
                raise RolloutError(
                    f"multi-turn rollout: the engine failed: {payload[0]}"
                ) from payload[0]
            if state.done:
                continue  # an answer that came after its episode failed
            if kind == "sample":
                self._on_sample(state, payload[0])
            elif payload[0] == state.call:  # "env": the call this episode waits for
                state.deadline = None
                self._on_env(state, *payload[1:])
                if not state.done:  # the model is next (_on_env left room for a token)
                    waiting.append(state)
            if state.done:
                active -= 1
        return [state.episode for state in states]

    # -- environment calls ----------------------------------------------------------------

    def _call_env(self, state: _State, what: str, fn, *args) -> None:
        state.call += 1
        call, events = state.call, self.events
        state.deadline = time.monotonic() + self.step_timeout

        def work():
            try:
                result = (True, fn(*args))
            except BaseException as err:  # handed to the runner thread, which fails the episode
                result = (False, err)
            events.put(("env", state, call, what, result))

        threading.Thread(
            target=work, name=f"episode-{state.episode.index}-{what}", daemon=True
        ).start()

    def _on_env(self, state: _State, what: str, result) -> None:
        ok, value = result
        if not ok:
            reason = value.reason if isinstance(value, EpisodeFailure) else "env_error"
            self._fail(state, reason, f"{what} raised {type(value).__name__}: {value}")
            return
        try:
            if what == "reset":
                state.env, first = value
                ids = observation_ids(
                    self.tokenizer, check_observation(first, allow_none=False), first=True
                )
                state.episode.prompt_ids, state.ids = list(ids), list(ids)
                if len(ids) >= self.max_model_len:
                    raise TypeError(
                        f"the first observation is {len(ids)} tokens; the model's length is "
                        f"{self.max_model_len}"
                    )
                return
            step = check_step_result(value)
        except (TypeError, ValueError) as err:
            self._fail(state, "env_bad_output", f"{what}: {err}")
            return
        episode = state.episode
        episode.rewards.append(step.reward)
        episode.infos.append(step.info)
        if step.observation is None:
            self._finish(state, "done")
        elif episode.turns >= self.budget.max_turns:
            self._finish(state, "max_turns")
        else:
            try:
                ids = observation_ids(
                    self.tokenizer, step.observation, first=False, after_eos=state.last_eos
                )
            except (TypeError, ValueError) as err:
                self._fail(state, "env_bad_output", f"step: {err}")
                return
            if self._room(state) - len(ids) < 1:
                self._finish(state, "max_tokens")
                return
            state.ids += ids
            episode.response_ids += ids
            episode.mask += [0] * len(ids)
            episode.logprobs += [0.0] * len(ids)
            episode.versions += [-1] * len(ids)

    # -- model turns ----------------------------------------------------------------------

    def _room(self, state: _State) -> int:
        """Tokens the episode may still add: within the budget and the model's length."""
        return min(
            self.budget.max_tokens - len(state.episode.response_ids),
            self.max_model_len - len(state.ids),
        )

    def _dispatch(self, waiting: list[_State]) -> int:
        """Send the waiting turns that share the first one's max_tokens as one call."""
        max_tokens = min(self.settings.max_tokens, self._room(waiting[0]))
        batch = [s for s in waiting if min(self.settings.max_tokens, self._room(s)) == max_tokens]
        for state in batch:
            waiting.remove(state)
        settings = replace(self.settings, max_tokens=max_tokens)
        prompts = [list(state.ids) for state in batch]
        engine, events = self.engine, self.events

        def work():
            try:
                stream = getattr(engine, "generate_stream", engine.generate)
                for sample in stream(prompts, settings):
                    events.put(("sample", batch[sample.prompt_index], sample))
            except BaseException as err:  # handed to the runner thread, which raises it
                events.put(("engine_error", None, err))
            events.put(("call_done", None))

        threading.Thread(target=work, name="episodes-generate", daemon=True).start()
        return 1

    def _on_sample(self, state: _State, sample) -> None:
        episode, tokens = state.episode, list(sample.token_ids)
        versions = [sample.version] * len(tokens)
        for span in sample.versions:
            versions[span.start : span.end] = [span.version] * (span.end - span.start)
        state.ids += tokens
        episode.response_ids += tokens
        episode.mask += [1] * len(tokens)
        episode.logprobs += list(sample.logprobs)
        episode.versions += versions
        episode.turn_ends.append(len(episode.response_ids) - 1)
        episode.turns += 1
        state.last_eos = bool(tokens) and tokens[-1] in self.eos
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        self._call_env(state, "step", state.env.step, text)

    # -- endings --------------------------------------------------------------------------

    def _finish(self, state: _State, reason: str) -> None:
        state.done, state.deadline = True, None
        episode = state.episode
        episode.finish_reason = reason
        episode.text = self.tokenizer.decode(episode.response_ids, skip_special_tokens=True)

    def _fail(self, state: _State, reason: str, detail: str) -> None:
        self._finish(state, "failed")
        state.episode.failure, state.episode.detail = reason, detail[:2000]


def observation_ids(
    tokenizer, observation: Observation, *, first: bool, after_eos: bool = False
) -> list[int]:
    """The token ids of an observation, tokenized on its own.

    Text is encoded with `tokenizer.encode(text)`, with special tokens added only to the first
    observation (as the engine does for a text prompt). Chat messages with a chat template: the
    first observation is the template's rendering of the messages with the generation prompt. A
    later one is the text that the template puts after a finished assistant turn, for the
    messages and the next generation prompt. That text starts with the template's end of the
    assistant's turn, minus its end-of-sequence token when the model generated that token itself
    (`after_eos`). Without a template, messages become "role: content" lines, then
    "assistant:".
    """
    tok = tokenizer
    if isinstance(observation, str):
        if first:
            return tok.encode(observation)
        return tok.encode(observation, add_special_tokens=False)
    if not getattr(tok, "chat_template", None):
        text = "".join(f"\n{m['role']}: {m['content']}" for m in observation) + "\nassistant:"
        return tok.encode(text.lstrip("\n") if first else text, add_special_tokens=False)
    if first:
        text = tok.apply_chat_template(observation, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    before = tok.apply_chat_template(base, tokenize=False)
    after = tok.apply_chat_template(base + observation, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier messages differently once more follow")
    closing = before[before.rindex(_SENTINEL) + len(_SENTINEL) :]  # e.g. "<|im_end|>\n"
    ended = [tok.decode([e]) for e in sorted(_eos_ids(tok))] if after_eos else []
    eos_text = next((t for t in ended if t and closing.startswith(t)), "")
    return tok.encode(closing[len(eos_text) :] + after[len(before) :], add_special_tokens=False)


def _eos_ids(tokenizer) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if isinstance(eos, int) else set(eos or ())


def failure_counts(episodes: Sequence[Episode]) -> dict[str, int]:
    """Count failed episodes by reason, with every reason present (zeros too): one metric per
    reason."""
    counts = Counter(e.failure for e in episodes if e.failure)
    return {reason: counts.get(reason, 0) for reason in FAILURE_REASONS}


class EpisodeFailuresError(RolloutError):
    """Too many episodes of a step failed; the message names the environment and the reasons."""


def check_failures(
    episodes: Sequence[Episode], environment: type | str, max_failed_fraction: float
) -> None:
    """Raise EpisodeFailuresError when more than `max_failed_fraction` of `episodes` failed."""
    failed = [e for e in episodes if e.failure]
    if not episodes or len(failed) <= max_failed_fraction * len(episodes):
        return
    reasons = ", ".join(f"{r} {n}" for r, n in failure_counts(episodes).items() if n)
    first = failed[0]
    raise EpisodeFailuresError(
        f"environment {environment_name(environment)}: {len(failed)} of {len(episodes)} episodes "
        f"failed (more than max_failed_fraction {max_failed_fraction:g}): {reasons}; "
        f"the first, episode {first.index}: {first.detail}"
    )
