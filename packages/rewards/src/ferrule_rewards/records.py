"""The plain records of a scoring call, free of protobuf types.

`Sample` is what a per-batch reward function receives, `Scores` is what a backend hands back to
the server for one batch, and `Result` is what the client returns for each sample. `Status`
names the per-sample outcomes of the wire format's `SampleStatus`. `Progress` is how a backend
tells its scoring process which sample it has started and what it finished.
"""

import math
import reprlib
from dataclasses import dataclass, field
from enum import StrEnum

# The sample fields, in wire order, as a reward function names them.
SAMPLE_FIELDS = (
    "prompt",
    "response",
    "prompt_token_ids",
    "response_token_ids",
    "label",
    "metadata",
)


class Status(StrEnum):
    OK = "ok"
    ERROR = "error"  # the reward function or model raised on this sample
    TIMEOUT = "timeout"  # the reward function did not return in time
    INVALID_REWARD = "invalid_reward"  # NaN, an infinity, or not a number
    INVALID_SAMPLE = "invalid_sample"  # the sample lacks what scoring needs


@dataclass(slots=True)
class Sample:
    """One model output, as a per-batch reward function sees it."""

    prompt: str = ""
    response: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    response_token_ids: list[int] = field(default_factory=list)
    label: str = ""  # empty when the sample has no label
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Scores:
    """A backend's answer for one batch: a reward per sample, with errors and sub-scores kept
    sparse, by index. Most batches have no errors and no sub-scores, and building nothing for
    them is what keeps the server fast."""

    rewards: list[float]
    errors: dict[int, tuple[Status, str]] = field(default_factory=dict)  # index -> why
    sub_scores: dict[int, dict[str, float]] = field(default_factory=dict)

    def fail(self, index: int, status: Status, message: str) -> None:
        self.errors[index] = (status, message)
        self.sub_scores.pop(index, None)

    def fail_all(self, status: Status, message: str) -> None:
        for index in range(len(self.rewards)):
            self.fail(index, status, message)


class Progress:
    """How a scorer reports on a batch while it scores it: `start` says which sample it has
    started, and `done` hands over each output as it comes. The scoring process (child.py)
    shares the started sample's index with the server, whose watchdog kills the process when one
    sample runs past the timeout. The scoring process also writes each output to the journal
    (journal.py), where the server finds it after a kill. So a kill loses no finished work, and
    no sample is scored twice.
    This base class does nothing. It serves scoring in the current process (tests, embedding)."""

    takes_outputs = False
    """True when `done` itself turns each output into its result, as child.py's _Reporter does.
    A scorer that passes every sample through `done` then leaves the rewards in its Scores at 0,
    instead of converting each output a second time."""

    def start(self, index: int) -> None:
        pass

    def done(self, index: int, output: object) -> None:
        pass


NO_PROGRESS = Progress()


@dataclass(slots=True)
class Result:
    """The score of one sample. `reward` is NaN unless `status` is OK, so that a failed sample
    cannot pass for a real reward of zero; check `ok` (or `error`) before using it."""

    reward: float
    status: Status = Status.OK
    error: str = ""
    sub_scores: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80


def short_repr(value: object) -> str:
    """A repr of `value` with bounded size and depth, for messages. `{value!r:.80}` would build
    the whole repr first (a list nested 200,000 deep raised RecursionError)."""
    try:
        return _REPR.repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def check_reward(value: object, what: str = "reward") -> float:
    """Return `value` as a finite float, or raise ValueError or TypeError saying what is wrong
    with it."""
    if isinstance(value, str | bytes) or not hasattr(type(value), "__float__"):
        raise TypeError(f"{what} is {type(value).__name__} {short_repr(value)}, expected a number")
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float's range (10**400) fails only its sample
        raise ValueError(
            f"{what} is {type(value).__name__} {str(value)[:10]}... ({len(str(value))} digits), "
            "too large for a float"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}, expected a finite number")
    return number
