"""The prompt group: one prompt's samples and their scores. Every group-relative decision is
made per group: GRPO's advantages, DAPO's filter, the staleness bound, trimming to a multiple of
the ranks, and best / worst ranking.

    groups = Group.split(samples, scores, 8, prompts)  # the engines' order: prompt, then sample
    kept = [g for g in groups if g.staleness(step) <= 1]
    samples, scores = flatten(kept)
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    samples: tuple
    scores: tuple[float, ...]  # the shaped scores that the step trains on
    prompt: object = None
    """Any object that the caller keeps with the group, such as the launcher's Problem. The
    trainer does not look at it."""

    def __post_init__(self):
        if not self.samples or len(self.samples) != len(self.scores):
            raise ValueError(
                f"a group needs one score per sample, got {len(self.samples)} samples and "
                f"{len(self.scores)} scores"
            )

    @classmethod
    def split(
        cls, samples: Sequence, scores: Sequence[float], n: int, prompts: Sequence | None = None
    ) -> list["Group"]:
        """Cuts the samples and their scores into groups of `n` consecutive samples. This is the
        order the engines return: prompt, then sample. `prompts`, when given, has one prompt per
        group."""
        if len(scores) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(scores)} scores")
        cut = chunks(samples, n)
        prompts = [None] * len(cut) if prompts is None else prompts
        if len(prompts) != len(cut):
            raise ValueError(f"{len(cut)} groups of {n} samples, but {len(prompts)} prompts")
        return [
            cls(tuple(group), tuple(group_scores), prompt)
            for group, group_scores, prompt in zip(cut, chunks(scores, n), prompts, strict=True)
        ]

    @property
    def size(self) -> int:
        return len(self.samples)

    def staleness(self, step: int) -> int:
        """The number of policy versions between the group's oldest sample and the policy that
        step `step` trains. The samples of step `step` come from versions up to step - 1, so a
        sample of version step - 1 has staleness 0."""
        return step - 1 - min(sample.version for sample in self.samples)

    def best(self) -> int:
        """The index of the group's highest-scored sample (the first one among equals)."""
        return max(range(self.size), key=self.scores.__getitem__)

    def worst(self) -> int:
        return min(range(self.size), key=self.scores.__getitem__)


def chunks(items: Sequence, n: int) -> list[Sequence]:
    """Cuts `items` into consecutive runs of `n`. Each run is one group's worth of anything the
    engines return in prompt-then-sample order (samples, scores, episodes)."""
    if n < 1 or len(items) % n:
        raise ValueError(f"{len(items)} items do not make groups of {n}")
    return [items[start : start + n] for start in range(0, len(items), n)]


def flatten(groups: Sequence[Group]) -> tuple[list, list[float]]:
    """Every group's samples and scores, in order."""
    return (
        [sample for group in groups for sample in group.samples],
        [score for group in groups for score in group.scores],
    )
