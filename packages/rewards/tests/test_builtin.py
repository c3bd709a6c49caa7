"""The built-in reward functions: final-answer extraction, exact match, format reward."""

import pytest

from ferrule_rewards.builtin import (
    answers_match,
    char_match,
    exact_match,
    exact_text,
    final_answer,
    format_reward,
    math_reward,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the result is \\boxed{42}.", "42"),
        ("first \\boxed{1}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("work...\n#### 1,000\n", "1,000"),
        ("The answer is 7.", "7."),
        ("Answer: Paris", "Paris"),
        ("boxed wins: \\boxed{3}\nThe answer is 4", "3"),
        ("no answer here", None),
        ("unclosed \\boxed{12", None),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("answer", "reference", "same"),
    [
        ("1,000", "1000", True),
        ("1000.0", "1000", True),
        ("0.5", "1/2", True),
        ("$12$", "12", True),
        ("7.", "7", True),
        ("  Paris ", "paris", True),
        ("12", "13", False),
        ("Paris", "London", False),
        ("1/0", "1/0", True),  # not a number: compared as text
    ],
)
def test_answers_match(answer, reference, same):
    assert answers_match(answer, reference) is same


def test_exact_match():
    assert exact_match("I think the answer is 1,000.", "1000") == 1.0
    assert exact_match("\\boxed{999}", "1000") == 0.0
    assert exact_match("it is 1000", "1000") == 0.0  # no marked final answer
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("\\boxed{1}", "")


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("<think>add them</think> The answer is 4", 1.0),
        ("\\boxed{4}", 1.0),
        ("<think>still thinking... The answer is 4", 0.0),  # thinking never closed
        ("<think>The answer is 3</think> no final answer", 0.0),  # the answer is inside
        ("\\boxed{3} or \\boxed{4}", 0.0),  # hedging between two answers
        ("four", 0.0),
    ],
)
def test_format_reward(response, reward):
    assert format_reward(response) == reward


def test_math_reward_reports_both_parts():
    assert math_reward("<think>2+2</think> \\boxed{4}", "4") == {
        "reward": 1.1,
        "accuracy": 1.0,
        "format": 1.0,
    }
    assert math_reward("4", "4") == {"reward": 0.0, "accuracy": 0.0, "format": 0.0}


def test_rule_rewards():
    assert exact_text(" cba", " cba") == 1.0 and exact_text("cb", " cba") == 0.0
    assert char_match(" cba", " cba") == 1.0
    assert char_match("cbx", " cba") == pytest.approx(2 / 3)
    assert char_match("cbaa", " cba") == pytest.approx(3 / 4)  # too long costs too
    assert char_match("", " cba") == 0.0
