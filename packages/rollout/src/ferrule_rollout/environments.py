"""Environments for multi-turn episodes: the interface a user implements, and its loader.

    class Guess(Environment):
        def reset(self, prompt, label, metadata): return prompt
        def step(self, model_output): return StepResult(None, float(label in model_output))

    environment = load_environment("my_envs.py:Guess")      # or "package.module:Guess"

This module is plain Python, with no vLLM, torch or Ray in it. `episodes.run_episodes` makes one
environment instance per episode and calls its methods from worker threads, so many episodes run
at once (see README.md).
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ferrule_config.objects import load_object

# An observation is text, or chat messages ({"role": ..., "content": ...}) that the runner
# renders with the tokenizer's chat template (see episodes.py for the rule).
Observation = str | list[dict]

# Why an episode failed, with one metric per reason. The runner sets the env_* reasons. An
# environment raises EpisodeFailure with a tool_* reason (ToolEnvironment does).
FAILURE_REASONS = (
    "env_error",  # reset / step raised
    "env_timeout",  # reset / step ran past the runner's step_timeout
    "env_bad_output",  # reset / step returned something that is not an observation / StepResult
    "tool_error",  # a tool raised something other than ToolError
    "tool_timeout",  # a tool ran past its per-call timeout (its process was killed)
    "tool_bad_output",  # a tool returned something that is neither text nor JSON
)


class EnvironmentLoadError(ValueError):
    """Raised for an environment spec that names no usable class. The message names the spec."""


class EpisodeFailure(Exception):
    """Raised by an environment to fail its episode with one of FAILURE_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in FAILURE_REASONS:
            raise ValueError(f"failure reason must be one of {FAILURE_REASONS}, got {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class StepResult:
    """What `Environment.step` returns (a plain 3-tuple in this order works too)."""

    observation: Observation | None
    """The next observation, appended to the episode as tokens; None ends the episode."""
    reward: float = 0.0
    """This turn's reward (the per-turn rewards of an episode sum to its total)."""
    info: dict = field(default_factory=dict)
    """Anything to keep with the episode (logged, not trained on)."""


@dataclass(frozen=True)
class EpisodeBudget:
    """Limits of one episode; whichever is reached first ends it."""

    max_turns: int = 8
    """Model turns (generate calls) per episode."""
    max_tokens: int = 1024
    """Tokens after the first prompt, the model's and the observations' counted together."""

    def __post_init__(self):
        for name in ("max_turns", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EpisodeBudget.{name} must be an integer >= 1, got {value!r}")


class Environment:
    """The environment of one episode. Subclass it. The runner makes one instance per episode,
    with the run's keyword options (`environment(**options)`).

    Methods are plain (not async) and may block. The runner calls each one from a worker thread,
    with a timeout, so a slow step holds up only its own episode. Raise EpisodeFailure to fail
    the episode with a reason; any other exception fails it as "env_error".
    """

    stop: tuple[str, ...] = ()
    """Strings that end a model turn (added to the run's stop strings), e.g. "</tool_call>"."""

    def reset(self, prompt, label: str, metadata: Mapping) -> Observation:
        """Start the episode on a dataset row. Return the first observation (the prompt that the
        model answers first)."""
        raise NotImplementedError

    def step(self, model_output: str) -> StepResult:
        """Take the model's turn: its text, decoded from the tokens it generated. Return the next
        observation (None when the episode is over), this turn's reward, and info."""
        raise NotImplementedError


def check_observation(value, *, allow_none: bool) -> Observation | None:
    """Return `value` if it is an observation: text, or a non-empty list of {"role", "content"}
    messages with string values. Otherwise raise a TypeError that describes the value."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        return value
    raise TypeError(
        "an observation must be text or a non-empty list of {'role': str, 'content': str} "
        f"messages{' (or None to end the episode)' if allow_none else ''}, got "
        f"{_describe_value(value)}"
    )


def check_step_result(value) -> StepResult:
    """Return `step`'s return value as a checked StepResult (a 3-tuple is accepted too).
    Otherwise raise TypeError."""
    if isinstance(value, tuple) and not isinstance(value, StepResult) and len(value) == 3:
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise TypeError(
            "step must return a StepResult or an (observation, reward, info) tuple, got "
            + _describe_value(value)
        )
    observation = check_observation(value.observation, allow_none=True)
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise TypeError(f"a step's reward must be a finite number, got {_describe_value(reward)}")
    if not isinstance(value.info, Mapping):
        raise TypeError(f"a step's info must be a dict, got {_describe_value(value.info)}")
    return StepResult(observation, float(reward), dict(value.info))


def _describe_value(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + '...' if len(text) > 80 else text}"


def load_environment(spec: str) -> type[Environment]:
    """Import `module:Class` or `path/to/file.py:Class` (the same form that names reward
    functions). The class must subclass Environment. Modules are looked up from the current
    directory first, as `python -m` would (see ferrule_config.objects). Raise
    EnvironmentLoadError, naming the spec, when it names no such class."""
    try:
        target = load_object(spec, "environment", attribute="Class")
    except ValueError as error:
        raise EnvironmentLoadError(str(error)) from None
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise EnvironmentLoadError(
            f"environment {spec!r} is {_describe_value(target)}, not a subclass of "
            "ferrule_rollout.environments.Environment"
        )
    return target


def environment_name(environment: type | str) -> str:
    """`module:Class` of an environment class (or the spec itself), for messages and metrics."""
    if isinstance(environment, str):
        return environment
    return f"{environment.__module__}:{environment.__qualname__}"
