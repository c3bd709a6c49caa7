"""The RL step, whole: a rollout batch (samples and their rewards) in, the policy and the critic
trained, metrics out.

    step = RLStep(trainer, critic, group_size=8, pad_id=0, policy=ranks, reference=ref_ranks)
    scores, penalties = step.shape(samples, rewards, max_tokens=256)   # each draw's rewards, shaped
    groups = step.keep(Group.split(samples, scores, 8))   # DAPO's filter (all groups when off)
    metrics = step.train(5, groups)                                    # PPO epochs, or a recipe
    saved = step.state(); step.restore(saved)                          # across a resume

RLStep owns the decisions that every step makes, whatever it trains: score shaping (truncated
and overlong responses), which prompt groups are kept (DAPO's filter), and the counters of steps
skipped for non-finite gradients. It hands the groups to its recipe (recipes.py):
`PolicyGradient` (the PPO family: staleness, advantages by estimator, rollout correction, the
adaptive KL coefficient, PPO epochs), or, with `recipe` settings, `RejectionSampling` or
`IterativeDPO`. Whoever drives the run decides when each call happens. RLStep reaches the models
only through `Ranks` (ranks.py).
"""

from collections.abc import Callable, Sequence

import torch

from ferrule_trainer import rl
from ferrule_trainer.config import CriticConfig, TrainerConfig
from ferrule_trainer.groups import Group
from ferrule_trainer.nonfinite import SkippedSteps
from ferrule_trainer.ranks import Ranks
from ferrule_trainer.recipes import RECIPES, PolicyGradient, RecipeSettings


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
        recipe: RecipeSettings = None,
        max_staleness: int = 0,
        keep_group_mean: tuple[float, float] | None = None,
    ):
        """trainer, critic: the [trainer] and [critic] tables. group_size: samples per prompt
        (every batch is whole groups, in prompt then sample order). recipe: None for the PPO
        family ([trainer] estimator), or a recipe's settings (`RejectionSamplingConfig`,
        `IterativeDPOConfig`). max_staleness: how many policy versions older than the latest a
        sample may be. keep_group_mean: the (low, high) bounds of DAPO's filter on a group's
        mean score."""
        if (critic is None) != (critic_ranks is None):
            raise ValueError("a critic needs both its [critic] table and its ranks")
        self.trainer, self.critic = trainer, critic
        self.group_size, self.pad_id = group_size, pad_id
        self.policy, self.reference, self.critic_ranks = policy, reference, critic_ranks
        self.max_staleness, self.keep_group_mean = max_staleness, keep_group_mean
        # per role, the steps skipped in a row for non-finite gradients (up to max_skipped_steps)
        self.skips = {
            role: SkippedSteps(trainer.max_skipped_steps, role) for role in ("policy", "critic")
        }
        if recipe is None:
            self.recipe = PolicyGradient(self)
        elif type(recipe) in RECIPES:
            self.recipe = RECIPES[type(recipe)](self, recipe)
        else:
            raise ValueError(f"unknown recipe settings {recipe!r}")

    def state(self) -> dict:
        skipped = {role: s.in_a_row for role, s in self.skips.items()}
        return {**self.recipe.state(), "skipped_in_a_row": skipped}

    def restore(self, state: dict) -> None:
        self.recipe.restore(state)
        for role, count in state.get("skipped_in_a_row", {}).items():
            self.skips[role].in_a_row = count

    # -- before training: each draw's scores and groups --------------------------------------

    def shape(
        self, samples: Sequence, rewards: Sequence[float], *, max_tokens: int
    ) -> tuple[list[float], list[float]]:
        """Returns the scores a step trains on and each sample's overlong penalty. A truncated
        response (finish_reason "length") scores [trainer] truncated_score when that is set.
        The other responses get DAPO's overlong penalty when [trainer] overlong_buffer is
        set."""
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
        """Returns the prompt groups to train on. With keep_group_mean = (low, high), these are
        the groups whose mean score lies strictly between low and high (DAPO's dynamic sampling,
        `rl.keep_groups`); without it, all groups."""
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
        """Trains on a rollout batch's prompt groups for RL step `step`, using the recipe. The
        samples come from policy versions up to step - 1. Rejection sampling calls `on_chosen`
        with the samples it trains on, each as (group, index of the sample in the group)."""
        self._check_sizes(groups)
        return self.recipe.train(step, groups, on_chosen)
