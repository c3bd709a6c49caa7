"""The RL step, whole: a rollout batch (samples and their rewards) in, the policy and the critic
trained, metrics out.

    step = RLStep(trainer, critic, group_size=8, pad_id=0, policy=ranks, reference=ref_ranks)
    scores, penalties = step.shape(samples, rewards, max_tokens=256)   # each draw's rewards
    groups = step.keep(Group.split(samples, scores, 8))   # DAPO's filter's groups (all without)
    metrics = step.train(5, groups)                                    # PPO epochs, or a recipe
    saved = step.state(); step.restore(saved)                          # across a resume

It owns what a step decides: score shaping (truncated and overlong responses), which prompt
groups are trained (DAPO's filter, staleness, the ranks' multiple), the running reward moments,
advantages by estimator, rollout correction, the adaptive KL coefficient, PPO epochs of the
policy and the critic, and the recipes that train on ranked samples instead ([loop] algorithm:
rejection sampling, iterative DPO). Whoever drives the run decides when; it reaches the model
ranks only through `Ranks`: ferrule-launcher's Ray groups, or `LocalRanks` around an in-process
`Actor` / `Critic` (the tests). Every call returns a `Pending`, so the policy's, the reference's
and the critic's passes run at the same time where they live in different processes.
"""

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ferrule_trainer import rl
from ferrule_trainer.batch import Batch
from ferrule_trainer.config import CriticConfig, TrainerConfig
from ferrule_trainer.groups import Group, flatten
from ferrule_trainer.nonfinite import SkippedSteps
from ferrule_trainer.settings import (
    EpochPlan,
    ForwardPlan,
    PolicyLoss,
    PreferenceLoss,
    ValueLoss,
)

Pending = Callable[[], object]
"""A call in flight: calling it waits for the result (and raises the callee's error)."""

REL_TOL, ABS_TOL = 1e-9, 1e-12


def reaches(reward: float, threshold: float) -> bool:
    """Whether `reward` reaches `threshold`, within a rounding error (0.7 - 0.4 reaches 0.3)."""
    return reward >= threshold or math.isclose(reward, threshold, rel_tol=REL_TOL, abs_tol=ABS_TOL)


class Ranks(Protocol):
    """The data-parallel ranks of the policy, the reference or the critic, driven as one: a
    batch is split into equal contiguous shards, one per rank, and the results put back in
    order (log-probabilities, values) or, for training, the first rank's global metrics."""

    size: int

    def logprobs(
        self, batch: Batch, plan: ForwardPlan, temperature: float | None = None
    ) -> Pending: ...

    def values(self, batch: Batch, plan: ForwardPlan) -> Pending: ...

    def train_epochs(
        self, batch: Batch, plan: EpochPlan, loss: PolicyLoss | ValueLoss
    ) -> Pending: ...

    def likelihood_epochs(self, batch: Batch, plan: EpochPlan) -> Pending: ...

    def preference_epochs(self, batch: Batch, plan: EpochPlan, loss: PreferenceLoss) -> Pending: ...


class LocalRanks:
    """One in-process `Actor` or `Critic` as `Ranks` (a step without Ray: tests, notebooks)."""

    size = 1

    def __init__(self, model):
        self.model = model

    def logprobs(self, batch, plan, temperature=None) -> Pending:
        return _done(self.model.logprobs(batch, plan, temperature))

    def values(self, batch, plan) -> Pending:
        return _done(self.model.values(batch, plan))

    def train_epochs(self, batch, plan, loss) -> Pending:
        return _done(self.model.train_epochs(batch, plan, loss))

    def likelihood_epochs(self, batch, plan) -> Pending:
        return _done(self.model.likelihood_epochs(batch, plan))

    def preference_epochs(self, batch, plan, loss) -> Pending:
        return _done(self.model.preference_epochs(batch, plan, loss))


def _done(result) -> Pending:
    return lambda: result


class RLStep:
    def __init__(
        self,
        trainer: TrainerConfig,
        critic: CriticConfig | None,
        *,
        group_size: int,
        pad_id: int,
        policy: Ranks,
        reference: Ranks | None = None,
        critic_ranks: Ranks | None = None,
        algorithm: str = "rl",
        max_staleness: int = 0,
        keep_group_mean: tuple[float, float] | None = None,
        chosen_min_reward: float | None = None,
        dpo_beta: float = 0.1,
        dpo_nll_coef: float = 0.0,
    ):
        """trainer, critic: the [trainer] and [critic] tables. group_size: samples per prompt
        (every batch is whole groups, in prompt then sample order). algorithm: "rl" (PPO
        epochs with trainer.estimator), "rejection_sampling" or "iterative_dpo".
        max_staleness: how many versions older than the last a sample may be."""
        if algorithm not in ("rl", "rejection_sampling", "iterative_dpo"):
            raise ValueError(f"unknown algorithm {algorithm!r}")
        if (critic is None) != (critic_ranks is None):
            raise ValueError("a critic needs both its [critic] table and its ranks")
        self.trainer, self.critic = trainer, critic
        self.group_size, self.pad_id = group_size, pad_id
        self.policy, self.reference, self.critic_ranks = policy, reference, critic_ranks
        self.algorithm, self.max_staleness = algorithm, max_staleness
        self.keep_group_mean, self.chosen_min_reward = keep_group_mean, chosen_min_reward
        self.dpo_beta, self.dpo_nll_coef = dpo_beta, dpo_nll_coef
        # The state carried between steps ([trainer] kl_target, reward_norm = "running").
        self.kl_coef = trainer.kl_coef
        self.reward_moments = rl.RunningMoments()
        # steps skipped in a row for non-finite gradients, each role's, up to max_skipped_steps
        self.skips = {
            role: SkippedSteps(trainer.max_skipped_steps, role) for role in ("policy", "critic")
        }

    def state(self) -> dict:
        return {
            "kl_coef": self.kl_coef,
            "reward_moments": list(self.reward_moments),
            "skipped_in_a_row": {role: s.in_a_row for role, s in self.skips.items()},
        }

    def restore(self, state: dict) -> None:
        self.kl_coef = state.get("kl_coef", self.trainer.kl_coef)
        self.reward_moments = rl.RunningMoments(*state.get("reward_moments", ()))
        for role, count in state.get("skipped_in_a_row", {}).items():
            self.skips[role].in_a_row = count

    # -- before training: each draw's scores and groups --------------------------------------

    def shape(
        self, samples: Sequence, rewards: Sequence[float], *, max_tokens: int
    ) -> tuple[list[float], list[float]]:
        """The scores a step trains on, and each sample's overlong penalty: a truncated
        response (finish_reason "length") scores [trainer] truncated_score when that is set;
        the others get DAPO's overlong penalty when [trainer] overlong_buffer is set."""
        t, scores = self.trainer, list(rewards)
        penalties = [0.0] * len(samples)
        if t.overlong_buffer is not None:
            lengths = torch.tensor([len(s.token_ids) for s in samples])
            penalties = rl.overlong_penalty(
                lengths, max_tokens=max_tokens, buffer=t.overlong_buffer, factor=t.overlong_penalty
            ).tolist()
        for i, sample in enumerate(samples):
            if sample.finish_reason == "length" and t.truncated_score is not None:
                scores[i] = t.truncated_score
            else:
                scores[i] += penalties[i]
        return scores, penalties

    def keep(self, groups: Sequence[Group]) -> list[Group]:
        """The prompt groups to train on: with keep_group_mean = (low, high), those whose mean
        score lies strictly between (DAPO's dynamic sampling, `rl.keep_groups`); all without."""
        self._check_sizes(groups)
        if self.keep_group_mean is None or not groups:
            return list(groups)
        scores = torch.tensor([group.scores for group in groups])
        kept = rl.keep_groups(scores.flatten(), self.group_size, *self.keep_group_mean)
        return [groups[g] for g in kept]

    def _check_sizes(self, groups: Sequence[Group]) -> None:
        for index, group in enumerate(groups):
            if group.size != self.group_size:
                raise ValueError(
                    f"group {index} has {group.size} samples; the step's groups have "
                    f"{self.group_size} (samples_per_prompt)"
                )

    # -- the step ----------------------------------------------------------------------------

    def train(
        self,
        step: int,
        groups: Sequence[Group],
        on_chosen: Callable[[list[tuple[Group, int]]], None] | None = None,
    ) -> dict:
        """Train on a rollout batch's prompt groups for RL step `step` (their samples come from
        policy versions up to step - 1). on_chosen: rejection sampling hands it the samples it
        trains on, each as (its group, its index in the group)."""
        self._check_sizes(groups)
        if self.algorithm == "rejection_sampling":
            return self._best_of_n(step, groups, on_chosen)
        if self.algorithm == "iterative_dpo":
            return self._best_against_worst(step, groups)
        return self._ppo(step, groups)

    def _ppo(self, step: int, groups: Sequence[Group]) -> dict:
        """Reference / critic passes, advantages, PPO epochs of the policy and the critic."""
        t, n = self.trainer, self.group_size
        fresh = [group for group in groups if group.staleness(step) <= self.max_staleness]
        kept = rl.trim_groups(fresh, n, t.batch_multiple(self.critic))
        dropped = len(groups) - len(kept)
        if not kept:
            return {"dropped_stale_groups": dropped}
        samples, scores = flatten(kept)
        shaped = torch.tensor(scores, dtype=torch.float32)
        shaped, self.reward_moments = rl.shape_scores(
            shaped, self.reward_moments, norm=t.reward_norm, clip=t.reward_clip
        )
        batch = rl.build_batch(samples, self.pad_id)
        forward = t.forward_plan()  # rows and tokens per pass
        began, pending = time.perf_counter(), {}
        if t.needs_old_logprobs():  # else the training forward gives them (Actor.train_step)
            pending["old"] = self.policy.logprobs(batch, forward)
        if self.reference is not None:
            pending["ref"] = self.reference.logprobs(batch, forward)
        if self.critic_ranks is not None:
            pending["values"] = self.critic_ranks.values(batch, forward)
        done = {name: wait() for name, wait in pending.items()}
        forward_seconds = time.perf_counter() - began  # scoring passes, before the epochs
        old, ref, values = done.get("old"), done.get("ref"), done.get("values")
        advantages, returns = rl.estimate(
            t.estimator,
            shaped,
            batch,
            group_size=n,
            old_logprobs=old,
            ref_logprobs=ref,
            values=values,
            turn_rewards=rl.turn_rewards(samples, batch),
            kl_coef=self.kl_coef,
            kl_kind=t.kl_kind,
            kl_in=t.kl_in,
            kl_max=t.kl_max,
            gamma=t.gamma,
            lam=t.lam,
        )
        rollout_lp = rl.rollout_logprobs(samples, batch)
        loss = t.policy_loss(self.kl_coef)  # the adaptive coefficient of this step
        if old is None:  # on-policy: train_step reports vllm_kl and kl from its own forward
            result = {}
            policy = rl.policy_batch(batch, None, advantages, ref, loss.kl_coef)
            policy = policy.replace(rollout_logprobs=rollout_lp)
        else:
            weights, result = rl.rollout_correction(old, rollout_lp, batch, t.correction())
            policy = rl.policy_batch(batch, old, advantages, ref, loss.kl_coef, weights)
        policy_done = self.policy.train_epochs(policy, t.epoch_plan(), loss)
        if self.critic_ranks is not None:
            critic_done = self.critic_ranks.train_epochs(
                rl.critic_batch(batch, values, returns),
                t.epoch_plan(),
                ValueLoss(clip=self.critic.value_clip),
            )
            critic_metrics = critic_done()
            self.skips["critic"].count(step, critic_metrics)
            result.update({f"critic/{k}": v for k, v in critic_metrics.items()})
        metrics = dict(policy_done())  # losses and norms are already global
        self.skips["policy"].count(step, metrics)
        if old is None:  # measured by the training forward, over every rank
            result["vllm_kl"] = metrics.pop("vllm_kl")
            if ref is not None:
                result["kl"] = metrics.pop("kl")
        elif ref is not None:
            result["kl"] = rl.mean_kl(old, ref, batch.response_mask)
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
                    samples=len(samples),
                )
        result["dropped_stale_groups"] = dropped
        result["staleness"] = sum(step - 1 - s.version for s in samples) / len(samples)
        result["time/forward"] = forward_seconds  # of time/train: reference, old logprobs, values
        return result

    # -- the recipes -------------------------------------------------------------------------

    def _ranked(self, groups: Sequence[Group]) -> list[Group]:
        """The groups whose best sample by score reaches chosen_min_reward (all without it)."""
        floor = self.chosen_min_reward
        return [g for g in groups if floor is None or reaches(g.scores[g.best()], floor)]

    def _best_of_n(self, step: int, groups: Sequence[Group], on_chosen) -> dict:
        """Rejection sampling: SFT on the best sample of each prompt (by score), [trainer]
        epochs x mini_batches optimizer steps."""
        best = [(group, group.best()) for group in self._ranked(groups)]
        best = best[: len(best) - len(best) % self.policy.size]
        if not best:
            return {"train/chosen": 0}
        if on_chosen is not None:
            on_chosen(best)
        batch = rl.build_batch([group.samples[i] for group, i in best], self.pad_id)
        metrics = self.policy.likelihood_epochs(batch, self.trainer.epoch_plan())()
        self.skips["policy"].count(step, metrics)
        result = {f"train/{k}": v for k, v in metrics.items()}
        result["train/chosen"] = len(best)
        result["train/chosen_reward"] = sum(group.scores[i] for group, i in best) / len(best)
        return result

    def _best_against_worst(self, step: int, groups: Sequence[Group]) -> dict:
        """Iterative DPO: each prompt's best and worst sample by score as a preference pair
        (prompts whose samples all scored the same give none), [trainer] epochs x
        mini_batches DPO optimizer steps against the reference (the starting model)."""
        if self.reference is None:
            raise ValueError("iterative DPO needs a reference")
        pairs = [
            (group.samples[group.best()], group.samples[group.worst()])
            for group in self._ranked(groups)
            if group.scores[group.best()] > group.scores[group.worst()]
        ]
        ranks = math.lcm(self.policy.size, self.reference.size)
        pairs = pairs[: len(pairs) - len(pairs) % ranks]
        if not pairs:
            return {"train/pairs": 0}
        rows = [sample for pair in pairs for sample in pair]  # chosen even, rejected odd
        batch = rl.build_batch(rows, self.pad_id)
        ref = self.reference.logprobs(batch, self.trainer.forward_plan(), temperature=1.0)()
        batch = batch.replace(ref_logprobs=ref)
        dpo = PreferenceLoss(beta=self.dpo_beta, nll_coef=self.dpo_nll_coef)
        metrics = self.policy.preference_epochs(batch, self.trainer.epoch_plan(), dpo)()
        self.skips["policy"].count(step, metrics)
        result = {f"train/{k}": v for k, v in metrics.items()}
        result["train/pairs"] = len(pairs)
        return result
