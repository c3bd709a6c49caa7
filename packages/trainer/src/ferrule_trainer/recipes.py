"""How a step trains on its prompt groups. There is one class per recipe ([loop] algorithm), each
with its own settings (a table of config.py) and its own state across steps.

    PolicyGradient(step)             # "rl": advantages by [trainer] estimator, PPO epochs
                                     #   of the policy (and the critic)
    RejectionSampling(step, RejectionSamplingConfig(chosen_min_reward=0.5))  # SFT on best-of-n
    IterativeDPO(step, IterativeDPOConfig(beta=0.1))     # DPO on each prompt's best vs worst

`step` is the `RLStep` that owns the recipe. `Owner` lists what a recipe reads of it: its models
(`policy`, `reference`, `critic_ranks`), its [trainer] and [critic] tables, the pad id and the
skipped-step counters. A recipe's `train(step_number, groups, on_chosen)` returns the step's
metrics. `state()` and `restore()` carry what the recipe keeps between steps across a resume.
A new recipe needs a class here, its settings table in config.py, an entry in RECIPES and a
field of the launcher's Config.
"""

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ferrule_trainer import rl
from ferrule_trainer.config import (
    CriticConfig,
    IterativeDPOConfig,
    RejectionSamplingConfig,
    TrainerConfig,
)
from ferrule_trainer.groups import Group, flatten
from ferrule_trainer.nonfinite import SkippedSteps
from ferrule_trainer.ranks import Ranks
from ferrule_trainer.settings import PreferenceLoss, ValueLoss

REL_TOL, ABS_TOL = 1e-9, 1e-12


def reaches(reward: float, threshold: float) -> bool:
    """Whether `reward` reaches `threshold`, within a rounding error (0.7 - 0.4 reaches 0.3)."""
    return reward >= threshold or math.isclose(reward, threshold, rel_tol=REL_TOL, abs_tol=ABS_TOL)


class Owner(Protocol):
    """What a recipe reads of the step that owns it (step.RLStep)."""

    trainer: TrainerConfig
    critic: CriticConfig | None
    policy: Ranks
    reference: Ranks | None
    critic_ranks: Ranks | None
    group_size: int
    pad_id: int
    max_staleness: int
    skips: dict[str, SkippedSteps]  # "policy", "critic": non-finite steps in a row


class PolicyGradient:
    """The PPO family: reference / old-policy / critic passes, advantages by [trainer]
    estimator, rollout correction, PPO epochs of the policy and the critic. Keeps the adaptive
    KL coefficient and the running reward moments between steps."""

    def __init__(self, step: Owner):
        self.step = step
        self.kl_coef = step.trainer.kl_coef  # [trainer] kl_target adapts it
        self.reward_moments = rl.RunningMoments()  # [trainer] reward_norm = "running"

    def state(self) -> dict:
        return {"kl_coef": self.kl_coef, "reward_moments": list(self.reward_moments)}

    def restore(self, state: dict) -> None:
        self.kl_coef = state.get("kl_coef", self.step.trainer.kl_coef)
        self.reward_moments = rl.RunningMoments(*state.get("reward_moments", ()))

    def train(self, number: int, groups: Sequence[Group], on_chosen=None) -> dict:
        s, t = self.step, self.step.trainer
        fresh = [group for group in groups if group.staleness(number) <= s.max_staleness]
        kept = rl.trim_groups(fresh, s.group_size, t.batch_multiple(s.critic))
        dropped = len(groups) - len(kept)
        if not kept:
            return {"dropped_stale_groups": dropped}
        samples, scores = flatten(kept)
        shaped, self.reward_moments = rl.shape_scores(
            torch.tensor(scores, dtype=torch.float32),
            self.reward_moments,
            norm=t.reward_norm,
            clip=t.reward_clip,
        )
        batch = rl.build_batch(samples, s.pad_id)
        began = time.perf_counter()
        old, ref, values = self._score(batch)
        forward_seconds = time.perf_counter() - began  # scoring passes, before the epochs
        advantages, returns = rl.estimate(
            t.estimator,
            shaped,
            batch,
            group_size=s.group_size,
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
        policy_done = s.policy.train_epochs(policy, t.epoch_plan(), loss)
        if s.critic_ranks is not None:
            critic_done = s.critic_ranks.train_epochs(
                rl.critic_batch(batch, values, returns),
                t.epoch_plan(),
                ValueLoss(clip=s.critic.value_clip),
            )
            critic_metrics = critic_done()
            s.skips["critic"].count(number, critic_metrics)
            result.update({f"critic/{k}": v for k, v in critic_metrics.items()})
        metrics = dict(policy_done())  # losses and norms are already global
        s.skips["policy"].count(number, metrics)
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
        result["staleness"] = sum(number - 1 - x.version for x in samples) / len(samples)
        # the scoring passes (reference, old logprobs, values), a part of time/train
        result["time/forward"] = forward_seconds
        return result

    def _score(self, batch):
        """Returns (old log-probs, reference log-probs, values), each None where not needed.
        The three passes run at the same time when the models live in different processes."""
        s, t = self.step, self.step.trainer
        forward = t.forward_plan()  # rows and tokens per pass
        pending = {}
        if t.needs_old_logprobs():  # else the training forward gives them (Actor.train_step)
            pending["old"] = s.policy.logprobs(batch, forward)
        if s.reference is not None:
            pending["ref"] = s.reference.logprobs(batch, forward)
        if s.critic_ranks is not None:
            pending["values"] = s.critic_ranks.values(batch, forward)
        done = {name: wait() for name, wait in pending.items()}
        return done.get("old"), done.get("ref"), done.get("values")


def _ranked(groups: Sequence[Group], floor: float | None) -> list[Group]:
    """The groups whose best score reaches `floor` (all groups when `floor` is None)."""
    return [g for g in groups if floor is None or reaches(g.scores[g.best()], floor)]


class RejectionSampling:
    """SFT on the best-scored sample of each prompt, for [trainer] epochs x mini_batches
    optimizer steps. `on_chosen` receives the samples that the step trains on."""

    def __init__(self, step: Owner, settings: RejectionSamplingConfig):
        self.step, self.settings = step, settings

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass

    def train(self, number: int, groups: Sequence[Group], on_chosen: Callable | None = None):
        s = self.step
        best = [(group, group.best()) for group in _ranked(groups, self.settings.chosen_min_reward)]
        best = best[: len(best) - len(best) % s.policy.size]
        if not best:
            return {"train/chosen": 0}
        if on_chosen is not None:
            on_chosen(best)
        batch = rl.build_batch([group.samples[i] for group, i in best], s.pad_id)
        metrics = s.policy.likelihood_epochs(batch, s.trainer.epoch_plan())()
        s.skips["policy"].count(number, metrics)
        result = {f"train/{k}": v for k, v in metrics.items()}
        result["train/chosen"] = len(best)
        result["train/chosen_reward"] = sum(group.scores[i] for group, i in best) / len(best)
        return result


class IterativeDPO:
    """DPO on each prompt's best and worst sample by score as a preference pair; prompts whose
    samples all scored the same give no pair. It runs [trainer] epochs x mini_batches DPO
    optimizer steps against the reference (the starting model)."""

    def __init__(self, step: Owner, settings: IterativeDPOConfig):
        if step.reference is None:
            raise ValueError("iterative DPO needs a reference")
        self.step, self.settings = step, settings

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass

    def train(self, number: int, groups: Sequence[Group], on_chosen=None) -> dict:
        s, settings = self.step, self.settings
        pairs = [
            (group.samples[group.best()], group.samples[group.worst()])
            for group in _ranked(groups, settings.chosen_min_reward)
            if group.scores[group.best()] > group.scores[group.worst()]
        ]
        ranks = math.lcm(s.policy.size, s.reference.size)
        pairs = pairs[: len(pairs) - len(pairs) % ranks]
        if not pairs:
            return {"train/pairs": 0}
        rows = [sample for pair in pairs for sample in pair]  # chosen even, rejected odd
        batch = rl.build_batch(rows, s.pad_id)
        ref = s.reference.logprobs(batch, s.trainer.forward_plan(), temperature=1.0)()
        batch = batch.replace(ref_logprobs=ref)
        dpo = PreferenceLoss(beta=settings.beta, nll_coef=settings.nll_coef)
        metrics = s.policy.preference_epochs(batch, s.trainer.epoch_plan(), dpo)()
        s.skips["policy"].count(number, metrics)
        result = {f"train/{k}": v for k, v in metrics.items()}
        result["train/pairs"] = len(pairs)
        return result


# settings class -> recipe class ("rl" has no settings class: RLStep takes recipe=None)
RECIPES = {RejectionSamplingConfig: RejectionSampling, IterativeDPOConfig: IterativeDPO}
RecipeSettings = RejectionSamplingConfig | IterativeDPOConfig | None
