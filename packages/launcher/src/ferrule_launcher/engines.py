"""The run's rollout engines: work is split between them, weights are loaded into them, and a
dead engine is replaced instead of ending the run.

    engines = Engines(config, roles, on_replaced=lambda: write_roles(...))
    samples = engines.generate(prompts, settings)   # a dead engine's share goes to its successor
    engines.sync(version)                            # every engine loads the policy's weights
    engines.each(lambda e: e.sleep.remote(), "sleep")   # one call on every engine

An engine whose actor dies (killed, out of memory, its process gone) is replaced by a new actor
on the same bundle. A weight-sync group cannot take a new member, so every group is opened
again with a new secret. Then the policy's weights, at the version the engines hold, are loaded
into every engine, and the dead engine's work (its share of the prompts, or a weight update) is
done again. A sender blocked on the dead engine is aborted at once instead of waiting for its
timeout. At most [rollout] max_restarts replacements happen within restart_window seconds; one
more death stops the run with that death's error (metric rollout/restarts).

`lock` keeps replacements apart from the trainer's step: the loop holds it from training
through the weight sync, so a replacement loads exactly the weights of the version the engines
hold.
"""

import contextlib
import random
import sys
import threading

from ferrule_launcher.calls import ActorDied, RestartBudget, RunError, get, get_each
from ferrule_launcher.config import Config
from ferrule_launcher.roles import Roles, open_weight_sync

PROBE_SECONDS = 30.0  # a live engine answers __ray_ready__ at once, even while it generates


class Engines:
    def __init__(self, config: Config, roles: Roles, on_replaced=None):
        self.config, self.roles = config, roles
        self.on_replaced = on_replaced or (lambda: None)
        self.lock = threading.RLock()
        self.version = 0  # the weight version every engine holds
        self.budget = RestartBudget(config.rollout.max_restarts, config.rollout.restart_window)
        self._abandoned: list = []  # refs of a failed weight sync's calls, fetched later

    @property
    def restarts(self) -> int:
        return self.budget.total

    # -- work ----------------------------------------------------------------------------

    def generate(self, prompts: list[str], settings) -> list:
        """Samples for `prompts`, split evenly over the engines, in prompt then sample order.
        The share of an engine that dies is generated again by its successor."""
        return self._spread(lambda e: e.generate, prompts, lambda chunk: ((chunk, settings), {}))

    def run_episodes(self, prompts: list, settings, environment) -> list:
        """Run one multi-turn episode (ferrule_rollout.episodes.Episode) per prompt (a
        task.Problem) on the engines, and return the episodes in order. `environment` is the
        [environment] table. The episodes run inside the engines' actors, next to the engines.
        If an engine dies, its successor runs its share again."""
        from ferrule_rollout.environments import EpisodeBudget

        budget = EpisodeBudget(environment.max_turns, environment.max_tokens)

        def arguments(chunk):
            options = {
                "labels": [p.label for p in chunk],
                "metadata": [dict(p.metadata) for p in chunk],
                "budget": budget,
                "options": environment.options,
                "step_timeout": environment.step_timeout,
            }
            return (environment.name, [p.text for p in chunk], settings), options

        return self._spread(lambda e: e.run_episodes, prompts, arguments)

    def _spread(self, method, items: list, arguments) -> list:
        """Call the actor method `method(engine)` of each engine on an even share of `items`,
        and join the results in order. `arguments(share)` gives the call's positional and
        keyword arguments."""
        import ray

        size = -(-len(items) // len(self.roles.engines))
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        pending, results = {}, {}

        def submit(index: int) -> None:
            engine = self.roles.engines[index]
            args, kwargs = arguments(chunks[index])
            pending[method(engine).remote(*args, **kwargs)] = (index, engine)

        for index in range(len(chunks)):
            submit(index)
        while pending:
            [ready], _ = ray.wait(list(pending), num_returns=1)
            index, engine = pending.pop(ready)
            try:
                results[index] = get(ready, f"rollout engine {index}")
            except ActorDied as died:
                self.replace({index: engine}, died)
                submit(index)
        return [result for index in range(len(chunks)) for result in results[index]]

    def each(self, call, what: str) -> list:
        """Run `call(engine)`, which returns an actor call's ref (`lambda e: e.sleep.remote()`),
        on every engine. If an engine died, it is replaced and the call is made again on all
        engines."""
        with self.lock:
            try:
                return self._each(call, what)
            except ActorDied as died:
                self.replace(self._dead(), died)
                return self._each(call, what)

    def _each(self, call, what: str) -> list:
        return get_each(
            [
                (call(engine), f"rollout engine {i} ({what})")
                for i, engine in enumerate(self.roles.engines)
            ]
        )

    def reseed(self, key: str) -> None:
        """Every engine draws its samples' random keys afresh from `key` and its own index
        (transformers engines: `TransformersEngine.reseed`), so that what a step samples depends
        only on the step. If an engine dies, it is replaced and every engine is reseeded again."""
        seeds = [
            random.Random(f"{key}/{i}").getrandbits(62) for i in range(len(self.roles.engines))
        ]
        with self.lock:
            for attempt in (1, 2):
                calls = [
                    (engine.reseed.remote(seeds[i]), f"rollout engine {i} (reseed)")
                    for i, engine in enumerate(self.roles.engines)
                ]
                try:
                    get_each(calls)
                    return
                except ActorDied as died:
                    if attempt == 2:
                        raise
                    self.replace(self._dead(), died)

    def sync(self, version: int) -> None:
        """Send the policy's weights to every engine as `version`. Running samples wait to
        finish on the old weights, or with async [loop] partial_rollout continue on the new
        ones."""
        with self.lock:
            try:
                self._load(version)
            except RunError as failed:
                dead = self._dead()
                if not dead:
                    raise
                self._recover(dead, failed, version)

    def _load(self, version: int) -> None:
        loop = self.config.loop  # sync partial rollouts cut their calls: no sample runs now
        mode = "keep" if loop.partial_rollout and loop.mode == "async" else "wait"
        receiving = [
            (e.update_weights.remote(mode), f"rollout engine {i} (weight sync receiver)")
            for i, e in enumerate(self.roles.engines)
        ]
        sending = [
            (ref, "policy (weight sync sender)") for ref in self.roles.policy.send_weights(version)
        ]
        try:
            results = get_each(receiving + sending)
        except RunError:  # fetch them once they end, or Ray prints their errors as unhandled
            self._abandoned += [ref for ref, _ in receiving + sending]
            raise
        self._settle()
        for index, got in enumerate(results[: len(receiving)]):
            if got != version:
                raise RunError(f"rollout engine {index} loaded version {got}, expected {version}")
        self.version = version

    def _settle(self) -> None:
        """Fetch the calls of failed weight syncs that have ended since, ignoring their errors:
        the run already acted on the first one."""
        import ray

        if not self._abandoned:
            return
        ready, self._abandoned = ray.wait(
            self._abandoned, num_returns=len(self._abandoned), timeout=0
        )
        for ref in ready:
            with contextlib.suppress(Exception):
                ray.get(ref)

    # -- replacing the dead ------------------------------------------------------------------

    def replace(self, dead: dict, cause: RunError) -> None:
        """Replace the engines in `dead` ({index: the handle that died}) unless another thread
        already did, and load the current weights into every engine."""
        with self.lock:
            dead = {i: e for i, e in dead.items() if self.roles.engines[i] is e}
            if dead:
                self._recover(dead, cause, self.version)

    def _recover(self, dead: dict, cause: RunError, version: int) -> None:
        """Start new actors for the dead engines, open new weight-sync groups for all engines,
        and load `version` into every engine. Repeat while more engines die meanwhile."""
        while True:
            self._abort_senders(f"{cause}")
            for index in dead:
                self._restart(index, cause)
            try:
                if self.config.rollout.sleep_between_phases:  # the successor is awake
                    self._each(lambda e: e.wake_up.remote(), "wake up")
                open_weight_sync(
                    self.roles.weight_sync, self.roles.policy.workers, self.roles.engines
                )
                self._load(version)
                break
            except RunError as failed:
                dead, cause = self._dead(), failed
                if not dead:
                    raise
        self.on_replaced()

    def _restart(self, index: int, cause: RunError) -> None:
        import ray

        c = self.config.rollout
        if not self.budget.spend():
            raise RunError(
                f"{cause}; not replaced: {self.budget.recent} engine restart(s) in the last "
                f"{c.restart_window:g} s already ([rollout] max_restarts = {c.max_restarts}, "
                f"restart_window = {c.restart_window:g})"
            )
        ray.kill(self.roles.engines[index], no_restart=True)
        engine = self.roles.start_engine(index)
        get(engine.__ray_ready__.remote(), f"rollout engine {index} (restarted)")
        self.roles.engines[index] = engine
        print(
            f"{cause}; replaced by a new actor (engine restart {self.budget.recent} of at most "
            f"{c.max_restarts} in {c.restart_window:g} s; metric rollout/restarts)",
            file=sys.stderr,
            flush=True,
        )

    def _dead(self) -> dict:
        """{index: handle} of the engines whose actors are gone."""
        import ray

        probes = {e.__ray_ready__.remote(): (i, e) for i, e in enumerate(self.roles.engines)}
        ray.wait(list(probes), num_returns=len(probes), timeout=PROBE_SECONDS)
        dead = {}
        for ref, (index, engine) in probes.items():
            try:
                get(ref, f"rollout engine {index}", timeout=0)
            except ActorDied:
                dead[index] = engine
            except RunError:  # busy past the probe's deadline: alive
                pass
        return dead

    def _abort_senders(self, reason: str) -> None:
        """Senders blocked on a dead receiver give up now instead of after their timeout."""
        abort = [
            (w.abort_weight_sync.options(concurrency_group="control").remote(reason), "policy")
            for w in self.roles.policy.workers
        ]
        get_each(abort)  # wait before a new group opens: a late abort would end the new group
