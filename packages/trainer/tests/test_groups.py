"""The prompt group: cutting the engines' flat order into groups, and what a group decides."""

from dataclasses import dataclass

import pytest

from ferrule_trainer.groups import Group, chunks, flatten


@dataclass
class Sample:
    version: int = 0


def test_split_keeps_the_engines_order_and_flatten_undoes_it():
    samples = [Sample(v) for v in range(6)]
    groups = Group.split(samples, [0.5, 0.1, 0.2, 0.3, 0.4, 0.5], 3, prompts=["a", "b"])
    assert [g.prompt for g in groups] == ["a", "b"]
    assert groups[1].samples == tuple(samples[3:]) and groups[1].scores == (0.3, 0.4, 0.5)
    assert flatten(groups) == (samples, [0.5, 0.1, 0.2, 0.3, 0.4, 0.5])


@pytest.mark.parametrize(
    ("samples", "scores", "n", "prompts", "message"),
    [
        (5, 5, 2, None, "5 items do not make groups of 2"),
        (4, 3, 2, None, "4 samples but 3 scores"),
        (4, 4, 0, None, "do not make groups of 0"),
        (4, 4, 2, ["a"], "2 groups of 2 samples, but 1 prompts"),
    ],
)
def test_split_refuses_what_does_not_make_whole_groups(samples, scores, n, prompts, message):
    with pytest.raises(ValueError, match=message):
        Group.split([Sample()] * samples, [0.0] * scores, n, prompts)


def test_a_group_needs_a_score_per_sample():
    with pytest.raises(ValueError, match="one score per sample"):
        Group((Sample(),), (1.0, 2.0))
    with pytest.raises(ValueError, match="one score per sample"):
        Group((), ())


def test_staleness_is_its_oldest_samples():
    group = Group((Sample(4), Sample(2), Sample(4)), (0.0, 0.0, 0.0))
    assert group.staleness(6) == 3  # step 6 trains after version 5; the oldest is 2


def test_best_and_worst_take_the_first_of_equals_on_inexact_floats():
    group = Group((Sample(),) * 4, (0.1 + 0.2, 0.3, 0.1 + 0.2, -0.0))
    assert group.best() == 0  # 0.30000000000000004 > 0.3
    assert group.worst() == 3
    ties = Group((Sample(),) * 3, (0.7, 0.7, 0.7))
    assert ties.best() == 0 and ties.worst() == 0


def test_chunks_cuts_anything_in_runs():
    assert chunks("abcdef", 2) == ["ab", "cd", "ef"]
    assert chunks([], 3) == []
