"""The RL loop's schedule, sync or async: rollout -> rewards -> trainer's RL step -> weight sync.

    loop = Loop(config, roles, scorer, prompts, pad_id)   # prompts: data.make_prompts
    loop.run_sync(first_step, on_step)      # generate, score, train, sync; next step
    loop.run_async(first_step, on_step)     # generation of step k+1 overlaps training of step k

What is trained on, and how (score shaping, filtering, advantages, PPO epochs, the recipes), is
ferrule-trainer's `RLStep`. This file decides when each role does its part, and moves the data
between the roles.

Versions: the weights after s RL steps are policy version s. Step s trains on samples of
version >= s - 1 - max_staleness (sync mode without partial rollouts: exactly s - 1). Every
sample carries the version that produced it. The producer waits instead of generating too far
ahead, and the trainer drops whole prompt groups that are staler than allowed.
"""

import queue
import threading
import time

from ferrule_launcher.calls import get, get_each
from ferrule_launcher.config import Config
from ferrule_launcher.engines import Engines
from ferrule_launcher.roles import Roles
from ferrule_launcher.rollouts import Rollout, Rollouts
from ferrule_trainer import Group


class Loop:
    def __init__(
        self,
        config: Config,
        roles: Roles,
        rewards,
        prompts,
        pad_id: int,
        on_engine_replaced=None,
    ):
        self.config, self.roles, self.rewards, self.prompts = config, roles, rewards, prompts
        self.engines = Engines(config, roles, on_engine_replaced)
        self.version = 0  # the engines' weight version, which the producer waits on
        self.version_changed = threading.Condition()
        from ferrule_trainer import RLStep

        c = config
        self.step = RLStep(
            c.trainer,
            c.critic,
            group_size=c.rollout.samples_per_prompt,
            pad_id=pad_id,
            policy=roles.policy,
            reference=roles.reference,
            critic_ranks=roles.critic,
            recipe=c.recipe(),
            max_staleness=c.loop.max_staleness,
            keep_group_mean=c.loop.keep_group_mean,
        )
        self.rollouts = Rollouts(config, self.engines, rewards, prompts, self.step)

    def state(self) -> dict:
        """The state between steps: the RL step's state (adaptive KL coefficient, reward
        moments) and, with sync partial rollouts, the prompt groups still generating or
        waiting."""
        return {**self.step.state(), "rollouts": self.rollouts.state()}

    def restore(self, state: dict) -> None:
        self.step.restore(state)
        self.rollouts.restore(state.get("rollouts", {}))

    # -- the pieces of a step ---------------------------------------------------------------

    def train(self, rollout: Rollout) -> dict:
        """Run the trainer's RL step on one rollout batch (`RLStep.train`: PPO epochs, or the
        [loop] algorithm's recipe). Rejection sampling's chosen samples are written to disk."""
        return self.step.train(
            rollout.step,
            rollout.groups,
            on_chosen=lambda chosen: self._write_chosen(rollout.step, chosen),
        )

    def warm_up_trainer(self) -> list:
        """Start the policy's and the reference's passes on a made-up batch, so that their
        compiled layers compile (roles.RankWorker.warm_up). Returns (ref, label) pairs for
        get_each without waiting: the caller waits on them after what it runs on the engines
        meanwhile (the evaluation before RL). Returns no pairs when the trainer's states leave
        the GPUs while the engines generate, because the plan never has the trainer's states and
        the engines on the GPUs at once."""
        t = self.config.trainer
        if t.offload_between_phases:
            return []
        # The made-up warm-up batch has 2 rows. It holds a micro-batch's token budget (8192 when
        # that is not a number), but at most max_model_len tokens per row.
        budget = t.micro_batch_tokens if isinstance(t.micro_batch_tokens, int) else 8192
        tokens = min(budget, 2 * self.config.rollout.max_model_len)
        warm = dict(tokens=tokens, packed=t.pack_sequences, entropy=t.entropy_coef > 0)
        refs = [(r, "policy (warm-up)") for r in self.roles.policy.warm_up(
            **warm, score=t.needs_old_logprobs()
        )]  # fmt: skip
        if self.roles.reference is not None:
            refs += [(r, "reference (warm-up)") for r in self.roles.reference.warm_up(
                **warm, score=True
            )]  # fmt: skip
        return refs

    # -- the hybrid engine: which role holds the GPUs in each phase ([trainer]
    # offload_between_phases, [rollout] sleep_between_phases). Each method is a no-op when its
    # switch is off, or on CPU. ---------------------------------------------------------------

    def to_generate(self) -> None:
        """Move the trainer's states off the GPUs, to make room for the engines."""
        if self.config.trainer.offload_between_phases:
            self._each_trained(lambda group: group.offload(), "offload")

    def to_train(self) -> None:
        """The engines free their GPU memory (keeping their weights in host memory), and the
        trainer's states come back."""
        if self.config.rollout.sleep_between_phases:
            self.engines.each(lambda e: e.sleep.remote(), "sleep")
        if self.config.trainer.offload_between_phases:
            self._each_trained(lambda group: group.reload(), "reload")

    def to_sync(self) -> None:
        """The engines take their GPU memory back, to receive the new weights and generate.
        Before that, the trained models give back the memory their training activations
        reserved."""
        if self.config.rollout.sleep_between_phases:
            self._each_trained(lambda group: group.release_cache(), "release cache")
            self.engines.each(lambda e: e.wake_up.remote(), "wake up")

    def _each_trained(self, call, label: str) -> None:
        """Run `call(group)` on every rank of the policy and the critic, and wait for the calls.
        An error names the rank that failed ("policy (offload)")."""
        groups = [self.roles.policy] + (
            [self.roles.critic] if self.roles.critic is not None else []
        )
        get_each([(ref, f"{g.role} ({label})") for g in groups for ref in call(g)])

    def sync(self, version: int) -> float:
        """Send the policy's weights to every engine as `version`, and return the seconds taken.
        Running samples first finish on the old weights, or, with [loop] partial_rollout,
        continue on the new ones."""
        start = time.perf_counter()
        self.engines.sync(version)
        with self.version_changed:
            self.version = version
            self.version_changed.notify_all()
        return time.perf_counter() - start

    def _write_chosen(self, step: int, chosen: list[tuple[Group, int]]) -> None:
        """Write the samples rejection sampling trains on as SFT data (prompt, response,
        reward)."""
        import json
        from pathlib import Path

        folder = Path(self.config.output.dir) / "rejection_sampling"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"step{step}.jsonl", "w") as f:
            for group, i in chosen:
                row = {
                    "prompt": group.prompt.text,
                    "response": group.samples[i].text,
                    "reward": group.scores[i],
                }
                f.write(json.dumps(row) + "\n")

    def step_metrics(
        self, rollout: Rollout, trained: dict, seconds_train: float, seconds_sync: float
    ) -> dict:
        metrics = {
            **rollout.metrics,
            "version": self.version,
            "time/generate": rollout.seconds_generate,
            "time/score": rollout.seconds_score,
            "time/train": seconds_train,
            "time/sync": seconds_sync,
            "rewards/restarts": self.rewards.restarts if self.rewards is not None else 0,
            "rollout/restarts": self.engines.restarts,
        }
        epochs = self.prompts.epochs(rollout.step * self.config.rollout.prompts_per_step)
        if len(epochs) == 1:
            metrics["data/epoch"] = next(iter(epochs.values()))
        else:
            metrics.update({f"data/epoch/{name}": e for name, e in epochs.items()})
        metrics.update(trained)
        return metrics

    def _device_memory(self) -> float:
        """GB in use on policy rank 0's GPU, counting every role on it. Returns 0 without asking
        when the roles have no GPUs (saving two round trips per step)."""
        if not self.config.ray.gpus_per_role:
            return 0.0
        return get(self.roles.policy.workers[0].device_memory.remote(), "policy rank 0")

    def _eval_due(self, step: int) -> bool:
        every, last = self.config.loop.eval_every, self.config.loop.steps
        return step == last or (every > 0 and step % every == 0)

    # -- the two loops -----------------------------------------------------------------------

    def run_sync(self, first_step: int, on_step) -> None:
        for step in range(first_step, self.config.loop.steps + 1):
            rollout = self.rollouts.batch(step)
            self._finish_step(step, rollout, on_step)

    def _finish_step(self, step: int, rollout: Rollout, on_step) -> None:
        start = time.perf_counter()
        memory = {"gpu/used_gb_generate": self._device_memory()}
        with self.engines.lock:  # an engine replaced meanwhile gets this step's weights
            self.to_train()
            switched = time.perf_counter()
            trained = self.train(rollout)
            seconds_train = time.perf_counter() - switched
            memory["gpu/used_gb_train"] = self._device_memory()
            self.to_sync()
            seconds_sync = self.sync(step)
            self.to_generate()
        metrics = self.step_metrics(rollout, trained, seconds_train, seconds_sync)
        metrics["time/switch"] = time.perf_counter() - start - seconds_train - seconds_sync
        if any(memory.values()):
            metrics.update(memory)
        shown = None
        if self._eval_due(step):
            began = time.perf_counter()
            report, shown = self.rollouts.evaluate(step)
            metrics.update({f"eval/{k}": v for k, v in report.items()})
            metrics["time/eval"] = time.perf_counter() - began
        on_step(step, metrics, shown)

    def run_async(self, first_step: int, on_step) -> None:
        """A producer thread generates and scores batches ahead of the trainer, and passes them
        through a queue of `queue_size` batches. It stays at most `max_staleness` versions ahead
        of the weights the trainer will have."""
        loop = self.config.loop
        batches: queue.Queue = queue.Queue(maxsize=loop.queue_size)
        stop = threading.Event()

        def produce():
            try:
                for step in range(first_step, loop.steps + 1):
                    with self.version_changed:  # batch `step` is trained at version step - 1
                        while self.version < step - 1 - loop.max_staleness and not stop.is_set():
                            self.version_changed.wait(0.5)
                    if stop.is_set():
                        return
                    item = self.rollouts.batch(step)
                    while not stop.is_set():
                        try:
                            batches.put(item, timeout=0.5)
                            break
                        except queue.Full:
                            continue
            except BaseException as err:  # hand the failure to the trainer's thread
                batches.put(err)

        producer = threading.Thread(target=produce, name="rollout-producer", daemon=True)
        producer.start()
        try:
            for step in range(first_step, loop.steps + 1):
                item = batches.get()
                if isinstance(item, BaseException):
                    raise item
                self._finish_step(step, item, on_step)
        finally:
            stop.set()
            with self.version_changed:
                self.version_changed.notify_all()
            producer.join(timeout=60)
