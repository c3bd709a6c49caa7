"""Python reward functions as a scoring backend: load `module:function`, call it on a batch.

    scorer = FunctionScorer(load_function("ferrule_rewards.builtin:exact_match"), timeout=30)
    scores = await scorer.score([(response, label), ...])     # rows of scorer.fields

Two signatures, told apart by parameter names (checked when the function is loaded):
  per sample  parameters named after sample fields, any subset of them, called once per sample:
                  def reward(response: str, label: str) -> float
  per batch   one parameter named `samples`, a list of `records.Sample`, one call per batch:
                  def reward(samples: list[Sample]) -> list[float]
Either may be `async def`. A reward is a number, or a dict with a "reward" number and other
numbers as named sub-scores. Sync functions run in worker threads, so a slow one never blocks
the server; a sample that raises, returns NaN or runs past `timeout` gets its own status.
"""

import asyncio
import importlib
import importlib.util
import inspect
import logging
import math
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from ferrule_rewards.records import SAMPLE_FIELDS, Sample, Scores, Status, check_reward
from ferrule_rewards.threads import DaemonThreads

log = logging.getLogger(__name__)
_TIMED_OUT = object()  # marks an output whose call ran past the timeout
_MAX_ERROR_CHARS = 1000


def load_function(spec: str) -> Callable:
    """Import `module:function` or `path/to/file.py:function` (the function may be dotted,
    `module:Class.method`). Modules are looked up from the current directory first, as
    `python -m` would."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(
            f"reward function {spec!r}: expected 'module:function' or 'path/to/file.py:function'"
        )
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ValueError(f"reward function {spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module  # so pickling and dataclasses inside it work
        module_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            raise ValueError(
                f"reward function {spec!r}: cannot import {module_name!r}: {error}"
            ) from None
    target = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(
                f"reward function {spec!r}: {module_name} has no {attribute!r}"
            ) from None
    if not callable(target):
        raise ValueError(f"reward function {spec!r} is a {type(target).__name__}, not callable")
    return target


def signature_fields(fn: Callable) -> tuple[tuple[str, ...], bool, bool]:
    """(the sample fields `fn` takes, whether it is per batch, whether to pass them by
    position). TypeError naming the parameter when the signature fits neither form."""
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
    text = f"{type(error).__name__}: {error}{where}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


class _Batch:
    """One batch scored by worker threads, shared with the event loop that watches them."""

    __slots__ = ("cancelled", "claims", "current", "outputs", "rows")

    def __init__(self, rows: list):
        self.rows = rows
        # next() on a range iterator is atomic under the GIL: each index goes to one thread.
        self.claims = iter(range(len(rows)))
        # index -> output. Whoever calls setdefault first, the worker with the output or the
        # event loop with _TIMED_OUT, decides the sample's fate; no lock per sample.
        self.outputs: dict[int, object] = {}
        self.current = -1  # the index the live worker is scoring
        self.cancelled = False


def _work(fn: Callable, positional: bool, batch: _Batch) -> None:
    """Worker thread: claim and score samples until none are left, or until the event loop
    has timed out the sample this thread was stuck in (then a fresh thread carries on)."""
    rows, outputs = batch.rows, batch.outputs
    for index in batch.claims:
        batch.current = index
        try:
            output = fn(*rows[index]) if positional else fn(**rows[index])
        except BaseException as error:  # a worker thread gets no KeyboardInterrupt
            output = error
        if outputs.setdefault(index, output) is not output or batch.cancelled:
            return


class FunctionScorer:
    """Runs one reward function over batches of rows (tuples of `self.fields`).

    A sync function runs in worker threads. Python cannot stop a thread, so a call that runs
    past `timeout` is abandoned: its sample is marked timed out and a fresh thread scores the
    rest. `max_stuck` bounds the threads that may stay blocked that way; past it `healthy`
    turns False, and the server refuses calls and reports NOT_SERVING so that it is restarted.
    """

    def __init__(self, fn: Callable, *, timeout: float = 30.0, max_stuck: int = 16):
        if not timeout > 0:
            raise ValueError(f"reward function timeout must be > 0 seconds, got {timeout}")
        self.fn, self.timeout, self.max_stuck = fn, timeout, max_stuck
        self.name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        self.fields, self.batched, self.positional = signature_fields(fn)
        self.is_async = _is_async(fn)
        self.stuck = 0  # threads still inside a call that timed out
        self.on_health_change: Callable[[bool], None] | None = None  # set by the server
        self._threads = DaemonThreads()

    @property
    def healthy(self) -> bool:
        return self.stuck < self.max_stuck

    async def score(self, rows: list[tuple]) -> Scores:
        """Score samples given as tuples of the fields in `self.fields`, in that order."""
        scores = Scores([0.0] * len(rows))
        if self.batched:
            outputs = await self._score_batch([Sample(*row) for row in rows], scores)
        else:
            if not self.positional:
                rows = [dict(zip(self.fields, row, strict=True)) for row in rows]
            if self.is_async:
                outputs = await self._score_rows_async(rows)
            else:
                outputs = await self._score_rows_in_threads(rows)
        if outputs is not None:
            collect(outputs, scores, self.timeout)
        return scores

    async def _score_batch(self, samples: list[Sample], scores: Scores) -> list | None:
        if self.is_async:
            work = asyncio.ensure_future(self.fn(samples))
        else:
            work = self._threads.run(self.fn, samples)
        try:
            done, _ = await asyncio.wait({work}, timeout=self.timeout)
        finally:
            if self.is_async and not work.done():
                work.cancel()
        if not done:
            if not self.is_async:
                self._abandon(work)
            scores.fail_all(Status.TIMEOUT, f"no rewards for the batch within {self.timeout:g}s")
            return None
        try:
            outputs = work.result()
        except Exception as error:
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

    async def _score_rows_in_threads(self, rows: list) -> list:
        batch = _Batch(rows)
        try:
            while True:
                work = self._threads.run(_work, self.fn, self.positional, batch)
                if await self._watch(work, batch):
                    return [batch.outputs[index] for index in range(len(rows))]
        finally:
            batch.cancelled = True  # when the call was cancelled: stop after the current sample

    async def _watch(self, work: asyncio.Future, batch: _Batch) -> bool:
        """Wait for `work`: True when it finished the batch, False when it was abandoned in a
        sample that ran past the timeout. The sample in progress is checked every tenth of the
        timeout, so a sample times out after between 1 and 1.1 timeouts."""
        seen, seen_at = batch.current, time.monotonic()
        while True:
            done, _ = await asyncio.wait({work}, timeout=self.timeout / 10)
            if done:
                work.result()
                return True
            now = time.monotonic()
            if batch.current != seen:
                seen, seen_at = batch.current, now
            elif (
                now - seen_at >= self.timeout
                and seen >= 0  # a thread that has not claimed a sample yet is only slow to start
                and seen not in batch.outputs  # decided already: an earlier thread timed out
                and batch.outputs.setdefault(seen, _TIMED_OUT) is _TIMED_OUT
            ):
                self._abandon(work)
                return False

    def _abandon(self, work: asyncio.Future) -> None:
        self._count_stuck(+1)
        log.warning(
            "%s ran past its %gs timeout; %d worker thread(s) now stuck in it (limit %d)",
            self.name,
            self.timeout,
            self.stuck,
            self.max_stuck,
        )
        work.add_done_callback(self._unstick)

    def _unstick(self, _work) -> None:
        self._count_stuck(-1)

    def _count_stuck(self, change: int) -> None:
        was = self.healthy
        self.stuck += change
        if self.healthy != was and self.on_health_change:
            self.on_health_change(self.healthy)

    def close(self) -> None:
        self._threads.close()


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
                rewards[index], subs = _reward_of(output)
            except (TypeError, ValueError) as error:
                scores.fail(index, Status.INVALID_REWARD, str(error))
                continue
            if subs:
                scores.sub_scores[index] = subs


def _reward_of(output: object) -> tuple[float, dict[str, float]]:
    if not isinstance(output, Mapping):
        return check_reward(output), {}
    if "reward" not in output:
        raise ValueError(f"returned a dict without a 'reward' key: {sorted(output)!r:.200}")
    subs = {}
    for key, value in output.items():
        if key != "reward":
            if not isinstance(key, str):
                raise TypeError(f"sub-score name {key!r} is not a string")
            subs[key] = check_reward(value, f"sub-score {key!r}")
    return check_reward(output["reward"]), subs
