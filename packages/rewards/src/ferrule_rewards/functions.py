"""Python reward functions as a scoring backend: load `module:function`, call it on a batch.

    scorer = FunctionScorer(load_function("ferrule_rewards.builtin:exact_match"), timeout=30)
    scores = scorer.score([(response, label), ...])           # rows of scorer.fields

Two signatures, told apart by parameter names (checked when the function is loaded):
  per sample  parameters named after sample fields, any subset of them, called once per sample:
                  def reward(response: str, label: str) -> float
  per batch   one parameter named `samples`, a list of `records.Sample`, one call per batch:
                  def reward(samples: list[Sample]) -> list[float]
Either may be `async def`. A reward is a number, or a dict with a "reward" number and other
numbers as named sub-scores. A sample that raises or returns NaN gets its own status. The server
runs each scorer in a process of its own (child.py), and kills and replaces that process when a
sync call runs past `timeout`.
"""

import asyncio
import inspect
import math
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from ferrule_config.objects import load_object
from ferrule_rewards.records import (
    NO_PROGRESS,
    SAMPLE_FIELDS,
    Progress,
    Sample,
    Scores,
    Status,
    check_reward,
    short_repr,
)

_TIMED_OUT = object()  # marks an output whose call ran past the timeout
_MAX_ERROR_CHARS = 1000


def load_function(spec: str) -> Callable:
    """Import `module:function` or `path/to/file.py:function` (the function may be dotted,
    `module:Class.method`). Modules are looked up from the current directory first, as
    `python -m` would (see ferrule_config.objects)."""
    target = load_object(spec, "reward function", attribute="function")
    if not callable(target):
        raise ValueError(f"reward function {spec!r} is a {type(target).__name__}, not callable")
    return target


def signature_fields(fn: Callable) -> tuple[tuple[str, ...], bool, bool]:
    """Return (the sample fields `fn` takes, whether it is per batch, whether to pass the fields
    by position). Raise TypeError naming the parameter when the signature fits neither form."""
    name = getattr(fn, "__qualname__", repr(fn))
    params = list(inspect.signature(fn).parameters.values())
    if [p.name for p in params] == ["samples"]:
        return SAMPLE_FIELDS, True, True
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return SAMPLE_FIELDS, False, False
    fields = tuple(p.name for p in params if p.name in SAMPLE_FIELDS)
    bad = [
        p.name
        for p in params
        if p.name not in SAMPLE_FIELDS and p.default is p.empty and p.kind is not p.VAR_POSITIONAL
    ]
    if bad or not fields:
        raise TypeError(
            f"reward function {name}{inspect.signature(fn)}: "
            + (f"parameter(s) {', '.join(bad)} are not sample fields; " if bad else "")
            + f"a per-sample function takes any of {', '.join(SAMPLE_FIELDS)}; "
            "a per-batch function takes one parameter named `samples`"
        )
    leading = params[: len(fields)]
    positional = [p.name for p in leading] == list(fields) and all(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in leading
    )
    return fields, False, positional


def _is_async(fn: Callable) -> bool:
    # A callable object counts when its __call__ is a coroutine function.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _describe(error: BaseException) -> str:
    """`Type: message (at file:line)`, the line being the innermost frame of the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    try:
        message = str(error)
    except Exception:  # an exception whose __str__ raises
        message = "<unprintable>"
    text = f"{type(error).__name__}: {message[:_MAX_ERROR_CHARS]}{where}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


class FunctionScorer:
    """Runs one reward function over batches of rows (tuples of `self.fields`) in the calling
    process. In rlhf-rewards serve, that is a scoring process of child.py, which the server
    kills and replaces when a sync call runs past `timeout` (`hang_after`). Nothing here can stop
    a sync call, and nothing should try: a thread cannot be stopped, and a hang that holds the
    GIL freezes every thread of its process. An async function's samples run concurrently on the
    scorer's event loop and time out here. The scorer keeps one loop for its whole life, so that
    what the function binds to a loop (an aiohttp session, a client's connection pool) outlives
    a batch."""

    def __init__(self, fn: Callable, *, timeout: float = 30.0):
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"reward function timeout must be > 0 seconds, got {timeout}")
        self.fn, self.timeout = fn, timeout
        self.name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        self.fields, self.batched, self.positional = signature_fields(fn)
        self.is_async = _is_async(fn)
        # Seconds a process may go without starting another sample before the server takes it
        # for hung. An async function times out on its own event loop, and the margin lets
        # that timeout fire first.
        self.hang_after = timeout + max(1.0, timeout / 10) if self.is_async else timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def load(cls, spec: str, timeout: float = 30.0) -> "FunctionScorer":
        """Build the scorer of `module:function`. A partial of this method pickles, so a
        scoring process can receive it and build the scorer for itself."""
        return cls(load_function(spec), timeout=timeout)

    def score(self, rows: list[tuple], progress: Progress = NO_PROGRESS) -> Scores:
        """Score samples given as tuples of the fields in `self.fields`, in that order."""
        scores = Scores([0.0] * len(rows))
        if self.batched:
            progress.start(-1)
            outputs = self._score_batch([Sample(*row) for row in rows], scores)
        else:
            if not self.positional:
                rows = [dict(zip(self.fields, row, strict=True)) for row in rows]
            if self.is_async:
                progress.start(-1)
                outputs = self._run(self._score_rows_async(rows))
            else:
                outputs = self._score_rows(rows, progress)
                if progress.takes_outputs:  # `progress` has every result (see Progress)
                    return scores
        if outputs is not None:
            collect(outputs, scores, self.timeout)
        return scores

    def _score_rows(self, rows: list, progress: Progress) -> list:
        fn, positional, start, done = self.fn, self.positional, progress.start, progress.done
        outputs = []
        for index, row in enumerate(rows):
            start(index)
            try:
                output = fn(*row) if positional else fn(**row)
            except (Exception, SystemExit) as error:  # sys.exit also fails only this sample
                output = error
            outputs.append(output)
            done(index, output)
        return outputs

    def _score_batch(self, samples: list[Sample], scores: Scores) -> list | None:
        try:
            if self.is_async:
                outputs = self._run(asyncio.wait_for(self.fn(samples), self.timeout))
            else:
                outputs = self.fn(samples)
        except TimeoutError:
            scores.fail_all(Status.TIMEOUT, f"no rewards for the batch within {self.timeout:g}s")
            return None
        except (Exception, SystemExit) as error:
            scores.fail_all(Status.ERROR, _describe(error))
            return None
        if not isinstance(outputs, list | tuple) or len(outputs) != len(samples):
            got = len(outputs) if isinstance(outputs, list | tuple) else type(outputs).__name__
            scores.fail_all(
                Status.INVALID_REWARD,
                f"{self.name} returned {got} for {len(samples)} samples; "
                "a per-batch function returns a list with one reward per sample",
            )
            return None
        return list(outputs)

    async def _score_rows_async(self, rows: list) -> list:
        fn = self.fn
        tasks = [asyncio.ensure_future(fn(*row) if self.positional else fn(**row)) for row in rows]
        try:
            _, pending = await asyncio.wait(tasks, timeout=self.timeout)
        finally:
            for task in tasks:
                task.cancel()  # no-op for the finished ones
        return [_TIMED_OUT if t in pending else (t.exception() or t.result()) for t in tasks]

    def _run(self, coroutine):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)  # for code that asks asyncio.get_event_loop()
        return self._loop.run_until_complete(coroutine)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()
            self._loop = None


def collect(outputs: list, scores: Scores, timeout: float) -> None:
    """Turn what the function returned for each sample into `scores`."""
    # The common case, checked in C: only floats, and their sum is finite, so each one is.
    if set(map(type, outputs)) == {float} and math.isfinite(sum(outputs)):
        scores.rewards[:] = outputs
        return
    rewards = scores.rewards
    for index, output in enumerate(outputs):
        if type(output) is float and output - output == 0.0:  # finite (NaN - NaN is NaN)
            rewards[index] = output
            continue
        if output is _TIMED_OUT:
            scores.fail(index, Status.TIMEOUT, f"no reward within {timeout:g}s")
        elif isinstance(output, BaseException):
            scores.fail(index, Status.ERROR, _describe(output))
        else:
            try:
                rewards[index], subs = reward_of(output)
            except (TypeError, ValueError) as error:
                scores.fail(index, Status.INVALID_REWARD, str(error))
                continue
            except Exception as error:  # e.g. its __float__ raised: only this sample fails
                scores.fail(index, Status.ERROR, f"checking its reward: {_describe(error)}")
                continue
            if subs:
                scores.sub_scores[index] = subs


def reward_of(output: object) -> tuple[float, dict[str, float]]:
    """Return (reward, sub-scores) from what a function returned. Raise TypeError or ValueError
    saying what is wrong with it."""
    if not isinstance(output, Mapping):
        return check_reward(output), {}
    if "reward" not in output:
        raise ValueError(f"returned a dict without a 'reward' key: {short_repr(list(output))}")
    subs = {}
    for key, value in output.items():
        if key != "reward":
            if not isinstance(key, str):
                raise TypeError(f"sub-score name {short_repr(key)} is not a string")
            subs[key] = check_reward(value, f"sub-score {key!r:.80}")
    return check_reward(output["reward"]), subs
