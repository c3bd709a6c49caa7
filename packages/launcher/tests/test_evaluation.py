"""pass@k and the evaluation report against values computed by hand."""

import math
from itertools import combinations
from types import SimpleNamespace

import pytest

from ferrule_launcher.evaluation import generation, pass_at_k, succeeded, summarize
from ferrule_launcher.outputs import describe_generation


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (8, 0, 4, 0.0),
        (8, 8, 1, 1.0),
        (8, 5, 4, 1.0),  # n - c < k: every draw holds a success
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_success():
    outcomes = [True, False, False, True, False, False, False]  # n = 7, c = 2
    for k in range(1, 8):
        draws = list(combinations(outcomes, k))
        exact = sum(any(d) for d in draws) / len(draws)
        assert pass_at_k(7, 2, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_of_large_groups_does_not_overflow():
    # C(2000, 1000) overflows a float; the product form does not
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)
    assert 0.0 < pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_a_reward_that_misses_the_threshold_by_a_rounding_error_succeeds():
    assert 0.7 - 0.4 < 0.3  # 0.29999999999999993: naive >= would call this a failure
    assert succeeded(0.7 - 0.4, 0.3)
    assert succeeded(1.0, 1.0) and succeeded(2 / 3, 0.6666666666666666)
    assert not succeeded(0.2999, 0.3) and not succeeded(0.0, 1e-6)


def test_summary_overall_and_per_source():
    groups = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
    report = summarize(groups, ["math", "math", "code"], k=2, threshold=1.0)
    assert report["reward"] == pytest.approx(3.5 / 12)
    # pass@1: 1/4, 2/4, 0 -> 0.25; pass@2: 0.5, 1 - C(2,2)/C(4,2) = 5/6, 0
    assert report["pass@1"] == pytest.approx(0.75 / 3)
    assert report["pass@2"] == pytest.approx((0.5 + 5 / 6) / 3)
    assert report["math/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert report["code/reward"] == 0.0 and report["code/pass@1"] == 0.0
    one_source = summarize(groups[:2], ["math", "math"], k=1, threshold=0.5)
    assert set(one_source) == {"reward", "pass@1"}  # no per-source copy of the same figures
    assert one_source["pass@1"] == pytest.approx((0.25 + 0.75) / 2)


def test_summary_with_every_group_all_equal():
    for value, expected in ((1.0, 1.0), (0.0, 0.0)):
        report = summarize([[value] * 8] * 3, ["a"] * 3, k=8, threshold=1.0)
        assert report["pass@1"] == report["pass@8"] == expected
        assert math.isclose(report["reward"], value)


def test_summary_refuses_mismatched_or_empty_input():
    with pytest.raises(ValueError, match="2 prompt groups but 1 sources"):
        summarize([[1.0], [0.0]], ["a"], k=1, threshold=1.0)
    with pytest.raises(ValueError, match="no held-out prompts"):
        summarize([], [], k=1, threshold=1.0)


def _sample(tokens: int, finish: str) -> SimpleNamespace:
    return SimpleNamespace(token_ids=list(range(tokens)), finish_reason=finish)


def test_an_evaluations_generation_cost_is_counted_over_its_calls():
    # the sampled call's short responses and the greedy call's run to the cap: the longest
    # response, not the mean, explains a slow evaluation
    sampled = [_sample(3, "stop"), _sample(5, "stop"), _sample(1, "stop"), _sample(7, "stop")]
    greedy = [_sample(16, "length"), _sample(16, "length")]
    report = generation([(sampled, 0.5), (greedy, 1.5)])
    assert report == {
        "generation/tokens": 48,
        "generation/seconds": 2.0,
        "generation/tokens_per_s": 24.0,
        "generation/response_length": 8.0,
        "generation/response_length/max": 16,
        "generation/truncated": pytest.approx(1 / 3),
    }
    assert describe_generation(report) == "48 tokens in 2.0 s, longest 16, 33% cut at max_tokens"
    assert generation([([], 0.0)])["generation/tokens"] == 0  # no held-out sample: no error
