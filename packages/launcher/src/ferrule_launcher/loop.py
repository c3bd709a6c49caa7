"""The RL loop's schedule: rollout -> rewards -> the trainer's RL step -> weight sync, sync or async.

    loop = Loop(config, roles, scorer, prompts, pad_id)   # prompts: task.make_prompts
    loop.run_sync(first_step, on_step)      # generate, score, train, sync; next step
    loop.run_async(first_step, on_step)     # generation of step k+1 overlaps training of step k

What is trained on and how (batch layout, advantages, PPO epochs) is ferrule-trainer's `rl`;
this file decides when each role does its part and moves the data between them.

Versions: the weights after s RL steps are policy version s. Step s trains on samples of
version >= s - 1 - max_staleness (sync mode: exactly s - 1); every sample carries the version
that produced it, the producer waits before generating too far ahead, and the trainer drops
whole prompt groups that are staler than allowed.
"""

import math
import queue
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ferrule_launcher import evaluation
from ferrule_launcher.calls import RunError, get, get_each
from ferrule_launcher.config import Config
from ferrule_launcher.engines import Engines
from ferrule_launcher.evaluation import succeeded
from ferrule_launcher.roles import Roles
from ferrule_launcher.task import Prompt, accuracy


@dataclass
class Rollout:
    step: int
    problems: list = field(default_factory=list)  # the kept prompt groups', in order
    samples: list = field(default_factory=list)  # theirs, samples_per_prompt per problem
    scores: list = field(default_factory=list)  # theirs, shaped (what the step trains on)
    metrics: dict = field(default_factory=dict)  # over every sample drawn, the dropped included
    seconds_generate: float = 0.0
    seconds_score: float = 0.0


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
        self.config, self.roles, self.rewards = config, roles, rewards
        self.prompts, self.held_out, self.pad_id = prompts, prompts.held_out, pad_id
        self.engines = Engines(config, roles, on_engine_replaced)
        self.version = 0  # of the engines' weights, for the producer to wait on
        self.launch_id = secrets.token_hex(4)  # this launch's, in every sample_id
        self.version_changed = threading.Condition()
        # The driver's own state, checkpointed: the adaptive KL coefficient and the moments of
        # every score so far ([trainer] kl_target, reward_norm = "running").
        from ferrule_trainer import rl

        self.kl_coef = config.trainer.kl_coef
        self.reward_moments = rl.RunningMoments()

    def state(self) -> dict:
        return {"kl_coef": self.kl_coef, "reward_moments": list(self.reward_moments)}

    def restore(self, state: dict) -> None:
        self.kl_coef = state.get("kl_coef", self.config.trainer.kl_coef)
        from ferrule_trainer import rl

        self.reward_moments = rl.RunningMoments(*state.get("reward_moments", ()))

    # -- the pieces of a step ---------------------------------------------------------------

    def generate(self, prompts: list[str], temperature: float, n: int) -> list:
        """Samples for `prompts`, split evenly over the engines, in prompt then sample order."""
        return self.engines.generate(prompts, self.config.rollout.sampling(n, temperature))

    def play(self, problems: list[Prompt], temperature: float, n: int) -> tuple[list, list | None]:
        """`n` samples of each problem, in prompt then sample order: one generation each, or
        with [environment] one multi-turn episode each (an Episode's `sample()`: the transcript
        as the response, the environment's tokens masked), then also the episodes."""
        environment = self.config.environment
        if environment is None:
            return self.generate([p.text for p in problems], temperature, n), None
        settings = self.config.rollout.sampling(1, temperature)
        episodes = self.engines.run_episodes(
            [p for p in problems for _ in range(n)], settings, environment
        )
        return [e.sample() for e in episodes], episodes

    def episode_scores(
        self, problems: list[Prompt], samples: list, episodes: list | None, n: int, step, where
    ) -> tuple[list[float], Counter, dict]:
        """Each sample's score before shaping, the reward server's failures by kind and its
        first errors: the reward server's (single-turn runs; [environment] reward =
        "reward_server"), the environment's (reward = "environment"), or both added ("sum").
        A failed episode scores 0."""
        environment = self.config.environment
        scores, failed, first_errors = [0.0] * len(samples), Counter(), {}
        if self.rewards is not None:
            scored = self.score_samples(problems, samples, n, step, where)
            self.rewards.report_new_failures(scored)
            scores, failed, first_errors = list(scored.rewards), scored.failed, scored.first_errors
        if episodes is not None:
            with_environment = environment.reward != "reward_server"
            for i, episode in enumerate(episodes):
                if episode.failure is not None:
                    scores[i] = 0.0
                elif with_environment:
                    scores[i] += episode.reward
        return scores, Counter(failed), first_errors

    def rollout(self, step: int) -> Rollout:
        """Generate and score a step's batch. With [loop] keep_group_mean, prompt groups whose
        mean score is outside the range are dropped and new prompts drawn in their place, up to
        [loop] max_draws draws in all (DAPO's dynamic sampling); the batch may then be short."""
        import torch

        from ferrule_trainer import rl

        c, n = self.config, self.config.rollout.samples_per_prompt
        want, bounds = c.rollout.prompts_per_step, c.loop.keep_group_mean
        rollout = Rollout(step)
        drawn, drawn_scores, drawn_sources, failed, penalties, draws = [], [], [], Counter(), [], 0
        drawn_episodes = []
        while len(rollout.problems) < want and draws < c.loop.max_draws:
            problems = self.prompts.draw(step, draws, want)
            start = time.perf_counter()
            samples, episodes = self.play(problems, c.rollout.temperature, n)
            generated = time.perf_counter()
            scores, failures, penalty = self.score(step, draws, problems, samples, episodes)
            rollout.seconds_generate += generated - start
            rollout.seconds_score += time.perf_counter() - generated
            draws += 1
            drawn += samples
            drawn_episodes += episodes or []
            drawn_scores += scores
            drawn_sources += [p.source for p in problems for _ in range(n)]
            failed.update(failures)
            penalties += penalty
            keep = range(len(problems))
            if bounds is not None:
                keep = rl.keep_groups(torch.tensor(scores), n, *bounds)
            if episodes is not None:  # a failed episode is not trained on, nor is its group
                keep = [
                    g for g in keep if all(e.failure is None for e in episodes[g * n : (g + 1) * n])
                ]
            for g in keep[: want - len(rollout.problems)]:
                rollout.problems.append(problems[g])
                rollout.samples += samples[g * n : (g + 1) * n]
                rollout.scores += scores[g * n : (g + 1) * n]
        rollout.metrics = {
            "reward": sum(drawn_scores) / len(drawn),
            "reward/failed": sum(failed.values()),
            **{f"reward/failed_{kind}": count for kind, count in failed.items()},
            "response_length": sum(len(s.token_ids) for s in drawn) / len(drawn),
            "tokens_per_s": sum(len(s.token_ids) for s in drawn)
            / max(rollout.seconds_generate, 1e-9),
            "reward/truncated": sum(s.finish_reason == "length" for s in drawn) / len(drawn),
        }
        rollout.metrics.update(_per_source(drawn_scores, drawn_sources))
        if c.environment is not None:
            rollout.metrics.update(_episode_metrics(drawn_episodes))
        if c.trainer.overlong_buffer is not None:
            rollout.metrics["reward/overlong_penalty"] = sum(penalties) / len(drawn)
        if c.loop.partial_rollout:
            mixed = sum(len(s.versions) > 1 for s in drawn)
            rollout.metrics["rollout/mixed_version_samples"] = mixed / len(drawn)
        if bounds is not None:
            rollout.metrics["filter/draws"] = draws
            rollout.metrics["filter/kept_groups"] = len(rollout.problems)
        return rollout

    def score(
        self, step: int, draw: int, problems: list, samples: list, episodes: list | None = None
    ) -> tuple[list, Counter, list]:
        """The shaped scores of one draw, its failures by kind, and each sample's overlong
        penalty. Shaping: a truncated response scores [trainer] truncated_score when that is
        set; the others get DAPO's overlong penalty when [trainer] overlong_buffer is set.
        Every sample goes with metadata the reward function may take: `step`, and a
        `sample_id` unique to it ("<launch>/<step>/<draw>/<index>"; a new launch id after a
        resume, whose repeated steps are new samples)."""
        import torch

        from ferrule_trainer import rl

        c, n = self.config, self.config.rollout.samples_per_prompt
        scores, failed, first_errors = self.episode_scores(
            problems, samples, episodes, n, step, f"{step}/{draw}"
        )
        if sum(failed.values()) / len(samples) > c.rewards.max_failed_fraction:
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(failed.items()))
            raise RunError(
                f"step {step}: reward function {self.rewards.name} failed on "
                f"{sum(failed.values())} of {len(samples)} samples ({kinds}), more than "
                f"[rewards] max_failed_fraction = {c.rewards.max_failed_fraction:g}; first "
                f"error: {next(iter(first_errors.values()))}"
            )
        if episodes is not None:
            from ferrule_rollout.episodes import EpisodeFailuresError, check_failures

            environment = c.environment
            try:
                check_failures(episodes, environment.name, environment.max_failed_fraction)
            except EpisodeFailuresError as err:
                raise RunError(f"step {step}: {err}") from None
        t, penalties = c.trainer, [0.0] * len(samples)
        if t.overlong_buffer is not None:
            lengths = torch.tensor([len(s.token_ids) for s in samples])
            penalties = rl.overlong_penalty(
                lengths,
                max_tokens=c.rollout.max_tokens,
                buffer=t.overlong_buffer,
                factor=t.overlong_penalty,
            ).tolist()
        for i, sample in enumerate(samples):
            if sample.finish_reason == "length" and t.truncated_score is not None:
                scores[i] = t.truncated_score
            else:
                scores[i] += penalties[i]
        return scores, failed, penalties

    def train(self, rollout: Rollout) -> dict:
        """The trainer's RL step on one rollout batch: reference / critic passes, advantages,
        PPO epochs of the policy and the critic (in parallel). Or a recipe's step ([loop]
        algorithm): train_best_of_n, train_best_against_worst."""
        recipe = self.config.loop.algorithm
        if recipe == "rejection_sampling":
            return self.train_best_of_n(rollout)
        if recipe == "iterative_dpo":
            return self.train_best_against_worst(rollout)
        import torch

        from ferrule_trainer import rl

        c, roles = self.config, self.roles
        t, n = c.trainer, c.rollout.samples_per_prompt
        samples = rollout.samples
        staleness = [rollout.step - 1 - s.version for s in samples]
        fresh = [
            g
            for g in range(len(samples) // n)
            if max(staleness[g * n : (g + 1) * n]) <= c.loop.max_staleness
        ]
        groups = rl.trim_groups(fresh, n, t.batch_multiple(c.critic))
        dropped = len(samples) // n - len(groups)
        if not groups:
            return {"dropped_stale_groups": dropped}
        rows = [g * n + i for g in groups for i in range(n)]
        samples = [samples[i] for i in rows]
        scores = torch.tensor([rollout.scores[i] for i in rows], dtype=torch.float32)
        scores, self.reward_moments = rl.shape_scores(
            scores, self.reward_moments, norm=t.reward_norm, clip=t.reward_clip
        )
        batch = rl.build_batch(samples, self.pad_id)
        rows_per_pass = t.forward_batch_size or t.micro_batch_size
        passes = {}
        if t.needs_old_logprobs():  # else the training forward gives them (Actor.train_step)
            passes["policy"] = roles.policy.shard("logprobs", batch, micro_batch_size=rows_per_pass)
        if roles.reference is not None:
            passes["reference"] = roles.reference.shard(
                "logprobs", batch, micro_batch_size=rows_per_pass
            )
        if roles.critic is not None:
            passes["critic"] = roles.critic.shard("values", batch, micro_batch_size=rows_per_pass)
        done = {kind: torch.cat(get(refs, kind)) for kind, refs in passes.items()}
        old, ref, values = done.get("policy"), done.get("reference"), done.get("critic")
        advantages, returns = rl.estimate(
            t.estimator,
            scores,
            batch,
            group_size=n,
            old_logprobs=old,
            ref_logprobs=ref,
            values=values,
            turn_rewards=rl.turn_rewards(samples, batch),
            **dict(t.estimate_options(), kl_coef=self.kl_coef),
        )
        rollout_lp = rl.rollout_logprobs(samples, batch)
        loss = t.loss_options()
        loss["kl_coef"] = self.kl_coef if loss["kl_coef"] else 0.0  # 0: the KL is in the reward
        if old is None:  # on-policy: train_step reports vllm_kl and kl from its own forward
            weights, result = None, {}
            policy = rl.policy_batch(batch, None, advantages, ref, loss["kl_coef"])
            policy["rollout_logprobs"] = rollout_lp
        else:
            weights, result = rl.rollout_correction(
                old, rollout_lp, batch, **t.correction_options()
            )
            policy = rl.policy_batch(batch, old, advantages, ref, loss["kl_coef"], weights)
        policy_calls = roles.policy.shard("train_epochs", policy, **t.epoch_options(), **loss)
        if roles.critic is not None:
            critic = roles.critic.shard(
                "train_epochs",
                rl.critic_batch(batch, values, returns),
                **t.epoch_options(),
                clip=c.critic.value_clip,
            )
            result.update({f"critic/{k}": v for k, v in get(critic, "critic")[0].items()})
        metrics = get(policy_calls, "policy")[0]  # losses and norms are already global
        if old is None:  # measured by the training forward, over every rank
            result["vllm_kl"] = metrics.pop("vllm_kl")
            if ref is not None:
                result["kl"] = metrics.pop("kl")
        elif ref is not None:
            result["kl"] = rl.mean_kl(old, ref, batch["response_mask"])
        result.update({f"train/{k}": v for k, v in metrics.items()})
        result["approx_kl"] = metrics.get("approx_kl", 0.0)
        if ref is not None:
            result["kl_coef"] = self.kl_coef
            if t.kl_target is not None:  # the coefficient for the next step
                self.kl_coef = rl.adapt_kl_coef(
                    self.kl_coef,
                    result["kl"],
                    target=t.kl_target,
                    horizon=t.kl_horizon,
                    samples=len(rows),
                )
        result["dropped_stale_groups"] = dropped
        result["staleness"] = sum(staleness[i] for i in rows) / len(rows)
        return result

    # -- the hybrid engine: who holds the GPUs when ([trainer] offload_between_phases, [rollout]
    # sleep_between_phases); each is a no-op where its switch is off or on CPU ----------------

    def to_generate(self) -> None:
        """The trainer's states leave the GPUs for the engines."""
        if self.config.trainer.offload_between_phases:
            calls = [(ref, "policy (offload)") for ref in self.roles.policy.call("offload")]
            if self.roles.critic is not None:
                calls += [(ref, "critic (offload)") for ref in self.roles.critic.call("offload")]
            get_each(calls)

    def to_train(self) -> None:
        """The engines free their GPU memory (weights kept in host memory); the trainer's
        states come back."""
        if self.config.rollout.sleep_between_phases:
            self.engines.each("sleep", "sleep")
        calls = []
        if self.config.trainer.offload_between_phases:
            calls += [(ref, "policy (reload)") for ref in self.roles.policy.call("reload")]
            if self.roles.critic is not None:
                calls += [(ref, "critic (reload)") for ref in self.roles.critic.call("reload")]
        get_each(calls)

    def to_sync(self) -> None:
        """The engines take their memory back, to receive the new weights and generate."""
        if self.config.rollout.sleep_between_phases:
            self.engines.each("wake_up", "wake up")

    def sync(self, version: int) -> float:
        """Send the policy's weights to every engine as `version`; returns the seconds taken.
        Running samples wait to finish on the old weights, or with [loop] partial_rollout
        continue on the new ones."""
        start = time.perf_counter()
        self.engines.sync(version)
        with self.version_changed:
            self.version = version
            self.version_changed.notify_all()
        return time.perf_counter() - start

    def _best(self, rollout: Rollout) -> list[tuple[int, int]]:
        """(best, worst) sample index of each prompt group by reward, for the groups whose best
        reaches [loop] chosen_min_reward."""
        n, floor = self.config.rollout.samples_per_prompt, self.config.loop.chosen_min_reward
        found = []
        for g in range(len(rollout.samples) // n):
            group = range(g * n, (g + 1) * n)
            best = max(group, key=lambda i: rollout.scores[i])
            if floor is None or succeeded(rollout.scores[best], floor):
                found.append((best, min(group, key=lambda i: rollout.scores[i])))
        return found

    def train_best_of_n(self, rollout: Rollout) -> dict:
        """Rejection sampling: SFT on the best sample of each prompt (by reward), [trainer]
        epochs x mini_batches optimizer steps; the step's chosen samples are written to
        <output dir>/rejection_sampling/."""
        from ferrule_trainer import rl

        best = [b for b, _ in self._best(rollout)]
        best = best[: len(best) - len(best) % len(self.roles.policy.workers)]
        if not best:
            return {"train/chosen": 0}
        self._write_chosen(rollout, best)
        batch = rl.build_batch([rollout.samples[i] for i in best], self.pad_id)
        calls = self.roles.policy.shard(
            "likelihood_epochs", batch, **self.config.trainer.epoch_options()
        )
        metrics = get(calls, "policy")[0]
        result = {f"train/{k}": v for k, v in metrics.items()}
        result["train/chosen"] = len(best)
        result["train/chosen_reward"] = sum(rollout.scores[i] for i in best) / len(best)
        return result

    def train_best_against_worst(self, rollout: Rollout) -> dict:
        """Iterative DPO: each prompt's best and worst sample by reward as a preference pair
        (prompts whose samples all scored the same give none), [trainer] epochs x
        mini_batches DPO optimizer steps against the reference (the starting model)."""
        import torch

        from ferrule_trainer import rl

        pairs = [(b, w) for b, w in self._best(rollout) if rollout.scores[b] > rollout.scores[w]]
        ranks = math.lcm(len(self.roles.policy.workers), len(self.roles.reference.workers))
        pairs = pairs[: len(pairs) - len(pairs) % ranks]
        if not pairs:
            return {"train/pairs": 0}
        rows = [i for pair in pairs for i in pair]  # chosen in even rows, rejected in odd ones
        batch = rl.build_batch([rollout.samples[i] for i in rows], self.pad_id)
        refs = self.roles.reference.shard(
            "logprobs",
            batch,
            micro_batch_size=self.config.trainer.micro_batch_size,
            temperature=1.0,
        )
        batch["ref_logprobs"] = torch.cat(get(refs, "reference"))
        calls = self.roles.policy.shard(
            "preference_epochs",
            batch,
            **self.config.trainer.epoch_options(),
            beta=self.config.loop.dpo_beta,
            nll_coef=self.config.loop.dpo_nll_coef,
        )
        metrics = get(calls, "policy")[0]
        result = {f"train/{k}": v for k, v in metrics.items()}
        result["train/pairs"] = len(pairs)
        return result

    def _write_chosen(self, rollout: Rollout, chosen: list[int]) -> None:
        """The samples rejection sampling trains on, as SFT data (prompt, response, reward)."""
        import json
        from pathlib import Path

        folder = Path(self.config.output.dir) / "rejection_sampling"
        folder.mkdir(parents=True, exist_ok=True)
        n = self.config.rollout.samples_per_prompt
        with open(folder / f"step{rollout.step}.jsonl", "w") as f:
            for i in chosen:
                row = {
                    "prompt": rollout.problems[i // n].text,
                    "response": rollout.samples[i].text,
                    "reward": rollout.scores[i],
                }
                f.write(json.dumps(row) + "\n")

    def score_samples(
        self, prompts: list[Prompt], samples: list, n: int, step: int, where: str
    ) -> object:
        """The reward server's scores of `samples` (n per prompt, in order). Each sample's
        metadata: the prompt's own, its `source`, the `step`, and a `sample_id` unique to it
        ("<launch>/<where>/<index>")."""
        return self.rewards.score(
            [prompts[i // n].text for i in range(len(samples))],
            [s.text for s in samples],
            [prompts[i // n].label for i in range(len(samples))],
            [
                {
                    **dict(prompts[i // n].metadata),
                    "source": prompts[i // n].source,
                    "step": str(step),
                    "sample_id": f"{self.launch_id}/{where}/{i}",
                }
                for i in range(len(samples))
            ],
        )

    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        """The held-out evaluation at `step`: [eval] samples per prompt at its temperature,
        scored by the run's reward function: mean reward, pass@1 and pass@k (evaluation.py);
        for the synthetic tasks also their own figure, greedy exact-match "accuracy". And the
        first sample of the first [output] sample_rows prompts, for the logs' sample tables."""
        e, held_out = self.config.eval, self.held_out
        n, prompts = e.samples, [p.text for p in held_out]
        samples, episodes = self.play(held_out, e.temperature, n)
        rewards, failed, _ = self.episode_scores(
            held_out, samples, episodes, n, step, f"eval{step}"
        )
        groups = [rewards[i * n : (i + 1) * n] for i in range(len(prompts))]
        sources = [p.source for p in held_out]
        report = evaluation.summarize(groups, sources, e.pass_k, e.threshold)
        report["reward_failed"] = sum(failed.values())
        if episodes is not None:
            report.update(_episode_metrics(episodes))
        shown = [
            {
                "source": p.source,
                "prompt": p.text,
                "response": samples[i * n].text,
                "label": p.label,
                "reward": rewards[i * n],
            }
            for i, p in enumerate(held_out[: self.config.output.sample_rows])
        ]
        if episodes is not None:  # the greedy episodes' success: a score reaching the threshold
            greedy, greedy_episodes = self.play(held_out, 0.0, 1)
            scores, _, _ = self.episode_scores(
                held_out, greedy, greedy_episodes, 1, step, f"eval{step}/greedy"
            )
            report["accuracy"] = sum(evaluation.succeeded(s, e.threshold) for s in scores) / len(
                scores
            )
        elif self.config.task.name != "data":
            greedy = self.generate(prompts, 0.0, 1)
            report["accuracy"] = accuracy([s.text for s in greedy], self.held_out)
        return report, shown

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
        """GB in use on policy rank 0's GPU, by every role on it; 0 where the roles have no
        GPUs, without asking (two round trips per step saved)."""
        if not self.config.ray.gpus_per_role:
            return 0.0
        return get(self.roles.policy.workers[0].device_memory.remote(), "policy rank 0")

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
            report, shown = self.evaluate(step)
            metrics.update({f"eval/{k}": v for k, v in report.items()})
        on_step(step, metrics, shown)

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


def _episode_metrics(episodes: list) -> dict:
    """Multi-turn figures over a batch of episodes: turns, the environment's reward, and the
    failed ones, overall and by reason (episodes/failed_<reason>, zeros included)."""
    from ferrule_rollout.episodes import failure_counts

    count = max(len(episodes), 1)
    by_reason = failure_counts(episodes)
    return {
        "episodes/turns": sum(e.turns for e in episodes) / count,
        "episodes/env_reward": sum(e.reward for e in episodes) / count,
        "episodes/failed": sum(by_reason.values()),
        **{f"episodes/failed_{reason}": n for reason, n in by_reason.items()},
    }


def _per_source(scores: list[float], sources: list[str]) -> dict:
    """Mean reward per source, "reward/<source>", when the samples come from more than one."""
    by_source: dict[str, list[float]] = {}
    for score, source in zip(scores, sources, strict=True):
        by_source.setdefault(source, []).append(score)
    if len(by_source) < 2:
        return {}
    return {f"reward/{name}": sum(v) / len(v) for name, v in sorted(by_source.items())}
