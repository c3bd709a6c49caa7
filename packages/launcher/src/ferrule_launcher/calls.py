"""Calls into the run's Ray actors, with failures that name the role: RunError, get, RankGroup.

    group = RankGroup(workers, "policy")       # ferrule-trainer's step.Ranks, over Ray actors
    metrics = group.train_epochs(batch, plan, loss)()  # one shard per rank; errors name the role
    metrics = get(refs, "policy")                         # refs of any call; errors name the role

A failed or dead actor becomes a RunError whose message names the role ("rollout engine 1",
"policy (weight sync sender)") and the first useful line of the remote error, so that the user
sees which component stopped the run instead of a Ray traceback. A dead actor raises
`ActorDied`, which a caller that can replace the actor catches (engines.py).
"""

import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrule_trainer import (
        Batch,
        EpochPlan,
        ForwardPlan,
        PolicyLoss,
        PreferenceLoss,
        ValueLoss,
    )


class RunError(RuntimeError):
    """The run cannot continue; the message names the role or component that failed."""


class ActorDied(RunError):
    """A role's actor is gone (killed, out of memory, or its node lost). It is a RunError, so it
    stops the run unless the caller can replace the actor."""


class RestartBudget:
    """At most `limit` restarts within any `window` seconds; `total` counts them all."""

    def __init__(self, limit: int, window: float):
        self.limit, self.window = limit, window
        self.total = 0
        self._times: deque[float] = deque()

    def spend(self) -> bool:
        """Take one restart if the window has room for it."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        self.total += 1
        return True

    @property
    def recent(self) -> int:
        """Restarts within the current window."""
        return len(self._times)


def get(refs, role: str, timeout: float | None = None):
    """ray.get that names the role when the actor died or the method raised. A list of refs is
    fetched as results arrive, so one failed rank stops the run at once instead of waiting
    for its peers, which may be stuck in a collective with it."""
    if isinstance(refs, list):
        return get_each([(ref, role) for ref in refs], timeout)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(refs, timeout=timeout)
    except RayActorError as err:
        raise ActorDied(f"the {role} actor died: {_first_line(err)}") from None
    except RayTaskError as err:
        raise RunError(f"the {role} failed: {_first_line(err.cause or err)}") from None
    except GetTimeoutError:
        raise RunError(f"the {role} did not answer within {timeout:g} s") from None


def get_each(pairs: list, timeout: float | None = None, arrivals: dict | None = None) -> list:
    """The results of [(ref, role), ...] in order; raises for the first one that fails. If
    given, `arrivals` receives {role: time.monotonic() when the role's last result came}."""
    import ray

    results, pending = {}, {ref: index for index, (ref, _) in enumerate(pairs)}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if not ready:
            roles = sorted({pairs[i][1] for i in pending.values()})
            raise RunError(f"{', '.join(roles)} did not answer within {timeout:g} s")
        index = pending.pop(ready[0])
        results[index] = get(ready[0], pairs[index][1])
        if arrivals is not None:
            arrivals[pairs[index][1]] = time.monotonic()
    return [results[i] for i in range(len(pairs))]


def _first_line(err) -> str:
    text = str(err).strip().split(" Some common causes include:")[0]  # cut the guide Ray appends
    lines = [line for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if "Error" in line or "error" in line]
    return (useful[-1] if useful else lines[-1] if lines else repr(err))[:500]


class RankGroup:
    """The data-parallel ranks of the policy, the reference or the critic (one Ray actor each,
    `roles.RankWorker`), driven as one: ferrule-trainer's `step.Ranks`. A batch is split into
    equal contiguous shards, one per rank; with [trainer] sequence_parallel there is one shard
    per sequence group, given to each rank of the group. Each call returns a `Pending` that
    waits for every rank, so the step can run the passes of the policy, the reference and the
    critic at the same time. The collectives (checkpoints, exports, offloading) return each
    rank's ref, for the caller to wait on under its own label."""

    def __init__(self, workers: list, role: str, sequence_parallel: int = 1):
        """`sequence_parallel`: how many consecutive ranks share each sequence (and its shard)."""
        self.workers, self.role, self.sequence_parallel = workers, role, sequence_parallel

    @property
    def size(self) -> int:
        return len(self.workers)

    def _on_shards(self, batch: "Batch", call) -> list:
        """Run `call(worker, shard)`, which returns a ref, on every rank with its share of
        `batch`. There is one share per sequence group, given to each rank of the group."""
        copies = self.sequence_parallel
        shards = batch.split(batch.rows * copies // self.size)
        return [call(w, shards[i // copies]) for i, w in enumerate(self.workers)]

    def _joined(self, refs: list):
        def wait():
            import torch

            return torch.cat(get(refs, self.role)[:: self.sequence_parallel])  # one per group

        return wait

    def _merged(self, refs: list):
        """Rank 0's training metrics, which are global, except "seconds", taken from the slowest
        rank (the step waits for it), and "compiles", summed over ranks."""

        def wait():
            each = get(refs, self.role)
            metrics = dict(each[0])
            if "seconds" in metrics:
                metrics["seconds"] = max(m["seconds"] for m in each)
                metrics["compiles"] = sum(m["compiles"] for m in each)
            return metrics

        return wait

    def logprobs(self, batch: "Batch", plan: "ForwardPlan", temperature: float | None = None):
        return self._joined(
            self._on_shards(batch, lambda w, shard: w.logprobs.remote(shard, plan, temperature))
        )

    def values(self, batch: "Batch", plan: "ForwardPlan"):
        return self._joined(self._on_shards(batch, lambda w, shard: w.values.remote(shard, plan)))

    def train_epochs(self, batch: "Batch", plan: "EpochPlan", loss: "PolicyLoss | ValueLoss"):
        return self._merged(
            self._on_shards(batch, lambda w, shard: w.train_epochs.remote(shard, plan, loss))
        )

    def likelihood_epochs(self, batch: "Batch", plan: "EpochPlan"):
        return self._merged(
            self._on_shards(batch, lambda w, shard: w.likelihood_epochs.remote(shard, plan))
        )

    def preference_epochs(self, batch: "Batch", plan: "EpochPlan", loss: "PreferenceLoss"):
        return self._merged(
            self._on_shards(batch, lambda w, shard: w.preference_epochs.remote(shard, plan, loss))
        )

    # -- collectives: every rank takes part ------------------------------------------------

    def warm_up(self, tokens: int, packed: bool, entropy: bool, score: bool) -> list:
        return [w.warm_up.remote(tokens, packed, entropy, score) for w in self.workers]

    def send_weights(self, version: int) -> list:
        return [w.send_weights.remote(version) for w in self.workers]

    def save(self, directory: str, step: int) -> list:
        return [w.save.remote(directory, step) for w in self.workers]

    def load(self, directory: str, step: int) -> list:
        return [w.load.remote(directory, step) for w in self.workers]

    def save_hf(self, path: str) -> list:
        return [w.save_hf.remote(path) for w in self.workers]

    def weights_digest(self) -> list:
        return [w.weights_digest.remote() for w in self.workers]

    def offload(self) -> list:
        return [w.offload.remote() for w in self.workers]

    def reload(self) -> list:
        return [w.reload.remote() for w in self.workers]

    def release_cache(self) -> list:
        return [w.release_cache.remote() for w in self.workers]
