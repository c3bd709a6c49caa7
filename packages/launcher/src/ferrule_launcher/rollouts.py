"""Scored rollout batches: generation (or multi-turn episodes) on the engines, scoring by the
reward server, the RL step's shaping and group filter, and the batch's metrics. Also the
held-out evaluation, which generates and scores samples the same way.

    rollouts = Rollouts(config, engines, rewards, prompts, step)   # step: ferrule-trainer RLStep
    batch = rollouts.batch(5)                # a Rollout: the kept prompt groups
    report, shown = rollouts.evaluate(5)     # mean reward, pass@k, accuracy; sample rows
"""

import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from ferrule_launcher import evaluation
from ferrule_launcher.calls import RunError
from ferrule_launcher.config import Config
from ferrule_launcher.engines import Engines
from ferrule_launcher.partial import PartialRollouts
from ferrule_launcher.task import Problem, accuracy
from ferrule_trainer import Group
from ferrule_trainer.groups import chunks, flatten


@dataclass
class Rollout:
    step: int
    groups: list[Group] = field(default_factory=list)  # kept groups; each `prompt` is a Problem
    metrics: dict = field(default_factory=dict)  # over every sample drawn, dropped ones included
    seconds_generate: float = 0.0
    seconds_score: float = 0.0
    tokens_generated: int = 0  # partial rollouts: by this step's calls, continuations included


class Rollouts:
    def __init__(self, config: Config, engines: Engines, rewards, prompts, step):
        """`rewards`: the RewardService (None when the environment scores); `prompts`: from
        data.make_prompts; `step`: the RL step (its `shape` and `keep` are used)."""
        self.config, self.engines, self.rewards, self.step = config, engines, rewards, step
        self.prompts, self.held_out = prompts, prompts.held_out
        self.launch_id = secrets.token_hex(4)  # this launch's id, part of every sample_id
        # sync partial rollouts: the groups in flight and waiting, across steps
        sync = config.loop.partial_rollout and config.loop.mode == "sync"
        self.partial = PartialRollouts(config, engines) if sync else None

    def state(self) -> dict:
        """For a checkpoint: the partial rollouts' groups in flight and waiting."""
        return self.partial.state() if self.partial else {}

    def restore(self, state: dict) -> None:
        if self.partial:
            self.partial.restore(state)

    def generate(self, prompts: list[str], temperature: float, n: int) -> list:
        """Samples for `prompts`, split evenly over the engines, in prompt then sample order."""
        return self.engines.generate(prompts, self.config.rollout.sampling(n, temperature))

    def play(self, problems: list[Problem], temperature: float, n: int) -> tuple[list, list | None]:
        """`n` samples of each problem, in prompt then sample order, and the episodes (None
        without [environment]). Each sample is one generation or, with [environment], one
        multi-turn episode: the Episode's `sample()`, whose response is the transcript with the
        environment's tokens masked."""
        environment = self.config.environment
        if environment is None:
            return self.generate([p.text for p in problems], temperature, n), None
        settings = self.config.rollout.sampling(1, temperature)
        episodes = self.engines.run_episodes(
            [p for p in problems for _ in range(n)], settings, environment
        )
        return [e.sample() for e in episodes], episodes

    def episode_scores(
        self, problems: list[Problem], samples: list, episodes: list | None, n: int, step, where
    ) -> tuple[list[float], Counter, dict]:
        """Each sample's score before shaping, the reward server's failures by kind, and its
        first error of each kind. The score is the reward server's (single-turn runs, or
        [environment] reward = "reward_server"), the environment's (reward = "environment"), or
        both added (reward = "sum"). A failed episode scores 0."""
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

    def batch(self, step: int) -> Rollout:
        """Generate and score a step's batch. With [loop] keep_group_mean, prompt groups whose
        mean score is outside the range are dropped and new prompts drawn in their place, up to
        [loop] max_draws draws in all (DAPO's dynamic sampling); the batch may then be short."""
        c, n = self.config, self.config.rollout.samples_per_prompt
        want, bounds = c.rollout.prompts_per_step, c.loop.keep_group_mean
        rollout, partial = Rollout(step), self.partial
        if partial:  # complete groups of earlier calls first
            rollout.groups = partial.take_ready(step, want)
        drawn, drawn_episodes, failed, penalties, draws = [], [], Counter(), [], 0
        # with partial rollouts every step continues the unfinished groups, or they grow stale
        while (len(rollout.groups) < want or (partial and partial.unfinished and not draws)) and (
            draws < c.loop.max_draws
        ):
            problems = self.prompts.draw(step, draws, want)
            if partial:
                problems = problems[: partial.new_groups(want)]
            if c.rollout.exact:  # samples depend only on the draw, so a resumed run repeats them
                self.engines.reseed(f"{c.loop.seed}/{step}/{draws}")
            start = time.perf_counter()
            if partial:
                problems, samples, tokens = partial.play(problems, n)
                rollout.tokens_generated, episodes = rollout.tokens_generated + tokens, None
            else:
                samples, episodes = self.play(problems, c.rollout.temperature, n)
            generated = time.perf_counter()
            if not samples:  # a cut call in which no group ended
                rollout.seconds_generate += generated - start
                draws += 1
                continue
            scores, failures, penalty = self.score(step, draws, problems, samples, episodes)
            rollout.seconds_generate += generated - start
            rollout.seconds_score += time.perf_counter() - generated
            draws += 1
            groups = Group.split(samples, scores, n, problems)
            drawn += groups
            drawn_episodes += episodes or []
            failed.update(failures)
            penalties += penalty
            if episodes is not None:  # a failed episode is not trained on, nor is its group
                groups = [
                    group
                    for group, played in zip(groups, chunks(episodes, n), strict=True)
                    if all(e.failure is None for e in played)
                ]
            kept, room = self.step.keep(groups), want - len(rollout.groups)
            rollout.groups += kept[:room]
            if partial:
                partial.ready += kept[room:]
        rollout.metrics = _drawn_metrics(drawn, rollout.seconds_generate)
        rollout.metrics["reward/failed"] = sum(failed.values())
        rollout.metrics.update({f"reward/failed_{kind}": count for kind, count in failed.items()})
        if c.environment is not None:
            rollout.metrics.update(_episode_metrics(drawn_episodes))
        if c.trainer.overlong_buffer is not None:
            rollout.metrics["reward/overlong_penalty"] = sum(penalties) / len(penalties)
        if c.loop.partial_rollout:
            samples, _ = flatten(drawn)
            mixed = sum(len(s.versions) > 1 for s in samples)
            rollout.metrics["rollout/mixed_version_samples"] = mixed / max(1, len(samples))
        if partial:
            seconds = max(rollout.seconds_generate, 1e-9)
            rollout.metrics["tokens_per_s"] = rollout.tokens_generated / seconds
            rollout.metrics.update(partial.metrics())
        if bounds is not None:
            rollout.metrics["filter/draws"] = draws
            rollout.metrics["filter/kept_groups"] = len(rollout.groups)
        return rollout

    def score(
        self, step: int, draw: int, problems: list, samples: list, episodes: list | None = None
    ) -> tuple[list, Counter, list]:
        """The shaped scores of one draw (`RLStep.shape`), its failures by kind, and each
        sample's overlong penalty. Each sample is sent with metadata the reward function may
        use: `step`, and a `sample_id` unique to the sample ("<launch>/<step>/<draw>/<index>").
        A resumed run has a new launch id, so its repeated steps are new samples."""
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
        scores, penalties = self.step.shape(samples, scores, max_tokens=c.rollout.max_tokens)
        return scores, failed, penalties

    def score_samples(
        self, prompts: list[Problem], samples: list, n: int, step: int, where: str
    ) -> object:
        """The reward server's scores of `samples` (n per prompt, in order). Each sample's
        metadata holds the prompt's own metadata, its `source`, the `step`, and a `sample_id`
        unique to the sample ("<launch>/<where>/<index>")."""
        each = [prompt for prompt in prompts for _ in range(n)]  # each sample's prompt
        return self.rewards.score(
            [p.text for p in each],
            [s.text for s in samples],
            [p.label for p in each],
            [
                {
                    **dict(p.metadata),
                    "source": p.source,
                    "step": str(step),
                    "sample_id": f"{self.launch_id}/{where}/{i}",
                }
                for i, p in enumerate(each)
            ],
        )

    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        """The held-out evaluation at `step`: [eval] samples per prompt at the [eval]
        temperature, scored by the run's reward function. The report has mean reward, pass@1
        and pass@k (evaluation.py), and a greedy "accuracy" for the synthetic tasks (exact
        match) and for multi-turn episodes (a score reaching [eval] threshold), and what the
        generation cost ("generation/...": evaluation.generation). Also returns the first sample
        of each of the first [output] sample_rows prompts, for the logs' sample tables."""
        e, held_out = self.config.eval, self.held_out
        n = e.samples
        began = time.perf_counter()
        samples, episodes = self.play(held_out, e.temperature, n)
        generated = [(samples, time.perf_counter() - began)]
        rewards, failed, _ = self.episode_scores(
            held_out, samples, episodes, n, step, f"eval{step}"
        )
        groups = Group.split(samples, rewards, n, held_out)
        sources = [p.source for p in held_out]
        report = evaluation.summarize([g.scores for g in groups], sources, e.pass_k, e.threshold)
        report["reward_failed"] = sum(failed.values())
        if episodes is not None:
            report.update(_episode_metrics(episodes))
        shown = [
            {
                "source": g.prompt.source,
                "prompt": g.prompt.text,
                "response": g.samples[0].text,
                "label": g.prompt.label,
                "reward": g.scores[0],
            }
            for g in groups[: self.config.output.sample_rows]
        ]
        if episodes is not None or self.config.task.name != "data":
            began = time.perf_counter()  # the greedy call alone: its scoring is not generation
            greedy, greedy_episodes = self.play(held_out, 0.0, 1)
            generated.append((greedy, time.perf_counter() - began))
            if greedy_episodes is not None:  # success: a score reaching the threshold
                scores, _, _ = self.episode_scores(
                    held_out, greedy, greedy_episodes, 1, step, f"eval{step}/greedy"
                )
                succeeded = [evaluation.succeeded(s, e.threshold) for s in scores]
                report["accuracy"] = sum(succeeded) / len(scores)
            else:  # the synthetic tasks: exact match
                report["accuracy"] = accuracy([s.text for s in greedy], held_out)
        report.update(evaluation.generation(generated))
        return report, shown


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


def _drawn_metrics(groups: list[Group], seconds_generate: float) -> dict:
    """Metrics over every group a step drew, dropped ones included: mean shaped reward (per
    source too, where there are several), response lengths, tokens/s and the truncated share."""
    samples, scores = flatten(groups)
    if not samples:  # partial rollouts: no group ended in this step's calls
        return {"tokens_per_s": 0.0}
    tokens = [len(s.token_ids) for s in samples]
    metrics = {
        "reward": sum(scores) / len(scores),
        "response_length": sum(tokens) / len(tokens),
        # the longest response sets how long the draw's tail decodes at low occupancy
        "response_length/max": max(tokens),
        "tokens_per_s": sum(tokens) / max(seconds_generate, 1e-9),
        "reward/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    sources = [g.prompt.source for g in groups for _ in g.samples]
    metrics.update(_per_source(scores, sources))
    return metrics


def _per_source(scores: list[float], sources: list[str]) -> dict:
    """Mean reward per source, "reward/<source>", when the samples come from more than one."""
    by_source: dict[str, list[float]] = {}
    for score, source in zip(scores, sources, strict=True):
        by_source.setdefault(source, []).append(score)
    if len(by_source) < 2:
        return {}
    return {f"reward/{name}": sum(v) / len(v) for name, v in sorted(by_source.items())}
