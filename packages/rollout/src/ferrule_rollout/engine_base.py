"""Code that both engines share: the version and pause state they report, resume, joining a
weight-sync group (each engine's `_join` does the joining itself), episodes, health, and `with`.

Generation, pausing and loading weights differ between the engines, so each engine keeps its
own (vllm_engine.py, hf_engine.py). vLLM steps requests in a loop of its own and can freeze them
mid-sample; the transformers engine runs one call at a time.
"""

import threading
from collections.abc import Callable

from ferrule_rollout.interface import WeightSyncGroup
from ferrule_rollout.samples import BadRequestError, RolloutError


class EngineBase:
    """The shared code of both engines, and the state that it reads.

    A subclass calls `super().__init__(model)` first and guards that state with `_cv`. It
    implements `_counts` (how many samples run and wait), `_workers` (how many weight-sync
    receivers the engine is) and `_join` (how the engine joins a weight-sync group)."""

    def __init__(self, model: str):
        self.model = model
        self._cv = threading.Condition()  # guards the fields below
        self._version = 0  # the policy version of the weights
        self._paused = False  # True: no new call starts
        self._frozen = False  # True: running samples do not advance either (vLLM's "keep" pause)
        self._closed = False
        self._broken = ""  # why the engine cannot generate ("" while healthy)
        self._startup: dict[str, float] = {}  # start-up seconds by phase

    def startup_seconds(self) -> dict[str, float]:
        """Seconds that this engine's start-up took, by phase: "imports", then "weights" (the
        transformers engine) or "engine" (vLLM's whole start: weights, profiling, KV cache,
        CUDA graphs)."""
        return {phase: round(seconds, 2) for phase, seconds in self._startup.items()}

    @property
    def version(self) -> int:
        """The policy version of the current weights (0 for the weights loaded at start)."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def resume(self) -> None:
        """Start the queued calls, and let the frozen ones continue."""
        with self._cv:
            self._paused = self._frozen = False
            self._cv.notify_all()

    def init_weight_sync(
        self,
        transport: str,
        host: str,
        port: int,
        rank: int,
        num_receivers: int,
        timeout: float = 300.0,
        secret: str | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        """Join the trainer's weight-sync group, leaving any previous group first.

        This blocks until the sender has joined too, for at most `timeout` seconds. An engine of
        several workers (vLLM with tensor parallelism) takes receiver ranks `rank` .. `rank +
        workers - 1`, and `num_receivers` counts every worker of every engine in the group.
        `secret` is the group's secret, when its sender has one. Setting `cancel` (or closing
        the engine) gives up the wait at once: the call raises JoinAbandoned, and no group is
        joined."""
        from ferrule_rollout.joining import JoinAbandoned

        self._check_receivers(transport, rank, self._workers(), num_receivers)
        group = WeightSyncGroup(transport, host, port, rank, num_receivers, timeout, secret)
        try:
            self._join(group, given_up=lambda: self._closed or bool(cancel and cancel.is_set()))
        except (BadRequestError, RolloutError, JoinAbandoned):
            raise
        except Exception as err:
            raise RolloutError(
                f"could not join the {transport} weight-sync group at {host}:{port}: {err}"
            ) from err

    def _workers(self) -> int:
        """The number of weight-sync receivers this engine is (one per worker)."""
        return 1

    def _join(self, group: WeightSyncGroup, given_up: Callable[[], bool]) -> None:
        """Join `group`. While waiting for peers, do not hold anything that generation needs.
        Raise JoinAbandoned as soon as `given_up()` returns True."""
        raise NotImplementedError

    def run_episodes(self, environment, prompts, settings=None, **options):
        """Run multi-turn episodes of `environment` on this engine, one per prompt (see
        ferrule_rollout.episodes.run_episodes). It is a method so that a Ray actor can run the
        episodes next to its engine."""
        from ferrule_rollout.episodes import run_episodes

        return run_episodes(self, environment, prompts, settings, **options)

    @staticmethod
    def _check_receivers(transport: str, rank: int, workers: int, num_receivers: int) -> None:
        """Check that a weight-sync request names a known transport, and that its receiver
        ranks rank .. rank + workers - 1 (one per worker of this engine) lie within
        1 .. num_receivers."""
        from ferrule_weightsync import TRANSPORTS

        if transport not in TRANSPORTS:
            raise BadRequestError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if rank >= 1 and rank + workers - 1 <= num_receivers:
            return
        if workers == 1:
            raise BadRequestError(f"receiver rank {rank} does not fit in 1..{num_receivers}")
        raise BadRequestError(
            f"receiver ranks {rank}..{rank + workers - 1} (one per worker) do not fit in "
            f"1..{num_receivers}"
        )

    def _counts(self) -> tuple[int, int]:
        """Return (samples running, samples queued). The caller holds `_cv`."""
        raise NotImplementedError

    def health(self) -> dict:
        with self._cv:
            status = "broken" if self._broken else "paused" if self._paused else "serving"
            running, queued = self._counts()
            return {
                "status": status,
                "detail": self._broken,
                "version": self._version,
                "model": self.model,
                "running": running,
                "queued": queued,
            }

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
