"""The RL loop: rollout -> rewards -> reference / critic -> advantages -> PPO epochs -> weight sync.

    loop = Loop(config, roles, rewards, problems)
    loop.run_sync(first_step, outputs, on_step)    # generate, score, train, sync; next step
    loop.run_async(first_step, outputs, on_step)   # generation of step k+1 overlaps training k

Versions: the weights after s RL steps are policy version s. Step s trains on samples of
version >= s - 1 - max_staleness (sync mode: exactly s - 1); every sample carries the version
that produced it, the producer waits before generating too far ahead, and the trainer drops
whole prompt groups that are staler than allowed.
"""

import queue
import threading
import time
from dataclasses import dataclass

from ferrule_launcher.batch import build_batch, estimate, split
from ferrule_launcher.config import Config
from ferrule_launcher.task import accuracy, training_problems


class RunError(RuntimeError):
    """The run cannot continue; the message names the role or component that failed."""


class PolicyGroup:
    """The policy's data-parallel ranks (one Ray actor each), driven as one: a batch is split
    into equal contiguous shards, one per rank; rank 0 holds the weight sender."""

    def __init__(self, workers: list):
        self.workers = workers

    def _shards(self, batch: dict) -> list[dict]:
        return split(batch, batch["input_ids"].shape[0] // len(self.workers))

    def logprobs(self, batch: dict):
        import torch

        refs = [
            w.logprobs.remote(s) for w, s in zip(self.workers, self._shards(batch), strict=True)
        ]
        return torch.cat(get(refs, "policy"))

    def train(self, batch: dict, **options) -> list:
        shards = self._shards(batch)
        return [w.train.remote(s, **options) for w, s in zip(self.workers, shards, strict=True)]

    def call(self, method: str, *args) -> list:
        """Refs of `method(*args)` on every rank (collectives: checkpoints, exports)."""
        return [getattr(w, method).remote(*args) for w in self.workers]


@dataclass
class Roles:
    policy: PolicyGroup
    engines: list
    reference: object = None
    critic: object = None


def get(refs, role: str, timeout: float | None = None):
    """ray.get that names the role when its actor died or its method raised. A list is
    fetched as results arrive, so one failed rank stops the run at once instead of waiting
    for its peers, which may be stuck in a collective with it."""
    if isinstance(refs, list):
        return get_each([(ref, role) for ref in refs], timeout)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(refs, timeout=timeout)
    except RayActorError as err:
        raise RunError(f"the {role} actor died: {_first_line(err)}") from None
    except RayTaskError as err:
        raise RunError(f"the {role} failed: {_first_line(err.cause or err)}") from None
    except GetTimeoutError:
        raise RunError(f"the {role} did not answer within {timeout:g} s") from None


def get_each(pairs: list, timeout: float | None = None) -> list:
    """Results of [(ref, role), ...] in order, raising for the first one that fails."""
    import ray

    results, pending = {}, {ref: index for index, (ref, _) in enumerate(pairs)}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if not ready:
            roles = sorted({pairs[i][1] for i in pending.values()})
            raise RunError(f"{', '.join(roles)} did not answer within {timeout:g} s")
        index = pending.pop(ready[0])
        results[index] = get(ready[0], pairs[index][1])
    return [results[i] for i in range(len(pairs))]


def _first_line(err) -> str:
    text = str(err).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if "Error" in line or "error" in line]
    return (useful[-1] if useful else lines[-1] if lines else repr(err))[:500]


@dataclass
class Rollout:
    step: int
    problems: list
    samples: list
    scores: list
    seconds_generate: float
    seconds_score: float


class Loop:
    def __init__(self, config: Config, roles: Roles, rewards, held_out: list, pad_id: int):
        self.config, self.roles, self.rewards = config, roles, rewards
        self.held_out, self.pad_id = held_out, pad_id
        self.version = 0  # of the engines' weights
        self.version_changed = threading.Condition()

    # -- the pieces of a step ---------------------------------------------------------------

    def generate(self, prompts: list[str], temperature: float, n: int) -> list:
        """Samples for `prompts`, split evenly over the engines, in prompt then sample order."""
        from ferrule_rollout import SamplingSettings

        r = self.config.rollout
        settings = SamplingSettings(
            n=n,
            temperature=temperature,
            top_p=r.top_p if temperature else 1.0,
            max_tokens=r.max_tokens,
            seed=None,
        )
        engines = self.roles.engines
        size = -(-len(prompts) // len(engines))
        chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        refs = [e.generate.remote(c, settings) for e, c in zip(engines, chunks, strict=False)]
        results = get_each([(ref, f"rollout engine {i}") for i, ref in enumerate(refs)])
        return [sample for result in results for sample in result]

    def rollout(self, step: int) -> Rollout:
        c = self.config
        problems = training_problems(
            c.task, c.rollout.prompts_per_step, c.task.seed + c.loop.seed, step, self.held_out
        )
        start = time.perf_counter()
        samples = self.generate(
            [p for p, _ in problems], c.rollout.temperature, c.rollout.samples_per_prompt
        )
        generated = time.perf_counter()
        n = c.rollout.samples_per_prompt
        scores = self.rewards.score(
            [problems[i // n][0] for i in range(len(samples))],
            [s.text for s in samples],
            [problems[i // n][1] for i in range(len(samples))],
        )
        return Rollout(
            step, problems, samples, scores, generated - start, time.perf_counter() - generated
        )

    def train(self, rollout: Rollout) -> dict:
        """Reference / critic passes, advantages and PPO epochs on one rollout batch."""
        import torch

        c, roles = self.config, self.roles
        t, n = c.trainer, c.rollout.samples_per_prompt
        samples, scores = rollout.samples, rollout.scores
        staleness = [rollout.step - 1 - s.version for s in samples]
        keep_groups = [
            g
            for g in range(len(samples) // n)
            if max(staleness[g * n : (g + 1) * n]) <= c.loop.max_staleness
        ]
        # Every rank takes an equal share and as many mini-batches: trim to a multiple.
        while len(keep_groups) * n % (t.ranks * t.mini_batches):
            keep_groups.pop()
        dropped = len(samples) // n - len(keep_groups)
        if not keep_groups:
            return {"dropped_stale_groups": dropped}
        rows = [g * n + i for g in keep_groups for i in range(n)]
        samples = [samples[i] for i in rows]
        scores_t = torch.tensor([scores[i] for i in rows], dtype=torch.float32)
        batch = build_batch(samples, self.pad_id)
        refs = {}
        if roles.reference is not None:
            refs["ref"] = roles.reference.logprobs.remote(batch)
        if roles.critic is not None:
            refs["values"] = roles.critic.values.remote(batch)
        old = roles.policy.logprobs(batch)
        ref = get(refs["ref"], "reference") if "ref" in refs else None
        values = get(refs["values"], "critic") if "values" in refs else None
        advantages, returns = estimate(
            t.estimator,
            scores_t,
            batch,
            group_size=n,
            old_logprobs=old,
            ref_logprobs=ref,
            values=values,
            kl_coef=t.kl_coef,
            kl_kind=t.kl_kind,
            kl_in=t.kl_in,
            gamma=t.gamma,
            lam=t.lam,
        )
        batch.update(old_logprobs=old, advantages=advantages)
        loss_kl = t.kl_coef if (t.kl_in == "loss" and ref is not None) else 0.0
        if loss_kl:
            batch["ref_logprobs"] = ref
        train_refs = roles.policy.train(
            batch,
            epochs=t.epochs,
            mini_batches=t.mini_batches,
            micro_batch_size=t.micro_batch_size,
            clip_low=t.clip_low,
            clip_high=t.clip_high,
            dual_clip=t.dual_clip,
            agg_mode=t.agg_mode,
            kl_coef=loss_kl,
            kl_kind=t.kl_kind,
            entropy_coef=t.entropy_coef,
        )
        critic_metrics = {}
        if roles.critic is not None:
            critic_batch = dict(batch, old_values=values, returns=returns)
            critic_batch = {
                k: critic_batch[k]
                for k in ("input_ids", "attention_mask", "response_mask", "old_values", "returns")
            }
            size = max(len(rows) // t.mini_batches, 1)
            for _ in range(t.epochs):
                for mini in split(critic_batch, size):
                    critic_metrics = get(
                        roles.critic.train_step.remote(
                            split(mini, t.micro_batch_size), clip=c.critic.value_clip
                        ),
                        "critic",
                    )
        metrics = get(train_refs, "policy")[0]  # losses and norms are already global
        mask = batch["response_mask"].bool()
        result = {f"train/{k}": v for k, v in metrics.items()}
        result.update({f"critic/{k}": v for k, v in critic_metrics.items()})
        result["approx_kl"] = metrics.get("approx_kl", 0.0)
        if ref is not None:
            result["kl"] = float(((old - ref) * mask).sum() / mask.sum())  # k1, mean per token
        result["dropped_stale_groups"] = dropped
        result["staleness"] = sum(staleness[i] for i in rows) / len(rows)
        return result

    def sync(self, version: int) -> float:
        """Send the policy's weights to every engine as `version`; returns the seconds taken."""
        start = time.perf_counter()
        receiving = [
            (e.update_weights.remote(), f"rollout engine {i} (weight sync receiver)")
            for i, e in enumerate(self.roles.engines)
        ]
        sending = [
            (ref, "policy (weight sync sender)")
            for ref in self.roles.policy.call("send_weights", version)
        ]
        results = get_each(receiving + sending)
        for index, got in enumerate(results[: len(receiving)]):
            if got != version:
                raise RunError(f"rollout engine {index} loaded version {got}, expected {version}")
        with self.version_changed:
            self.version = version
            self.version_changed.notify_all()
        return time.perf_counter() - start

    def evaluate(self) -> float:
        """Greedy accuracy on the held-out prompts."""
        samples = self.generate([p for p, _ in self.held_out], 0.0, 1)
        return accuracy([s.text for s in samples], self.held_out)

    def step_metrics(
        self, rollout: Rollout, trained: dict, seconds_train: float, seconds_sync: float
    ) -> dict:
        tokens = sum(len(s.token_ids) for s in rollout.samples)
        metrics = {
            "reward": sum(rollout.scores) / len(rollout.scores),
            "response_length": tokens / len(rollout.samples),
            "tokens_per_s": tokens / max(rollout.seconds_generate, 1e-9),
            "version": self.version,
            "time/generate": rollout.seconds_generate,
            "time/score": rollout.seconds_score,
            "time/train": seconds_train,
            "time/sync": seconds_sync,
        }
        metrics.update(trained)
        return metrics

    def _eval_due(self, step: int) -> bool:
        every, last = self.config.loop.eval_every, self.config.loop.steps
        return step == last or (every > 0 and step % every == 0)

    # -- the two loops -----------------------------------------------------------------------

    def run_sync(self, first_step: int, on_step) -> None:
        for step in range(first_step, self.config.loop.steps + 1):
            rollout = self.rollout(step)
            self._finish_step(step, rollout, on_step)

    def _finish_step(self, step: int, rollout: Rollout, on_step) -> None:
        start = time.perf_counter()
        trained = self.train(rollout)
        seconds_train = time.perf_counter() - start
        seconds_sync = self.sync(step)
        metrics = self.step_metrics(rollout, trained, seconds_train, seconds_sync)
        if self._eval_due(step):
            metrics["eval/accuracy"] = self.evaluate()
        on_step(step, metrics)

    def run_async(self, first_step: int, on_step) -> None:
        """A producer thread generates and scores ahead, at most `max_staleness` versions ahead
        of the weights the trainer will have, through a queue of `queue_size` batches."""
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
                    item = self.rollout(step)
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
