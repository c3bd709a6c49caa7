"""The built-in reward functions: final-answer extraction, exact match, format reward."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrule_rewards.builtin import (
    answers_match,
    char_match,
    exact_match,
    exact_text,
    final_answer,
    format_reward,
    math_reward,
    number_match,
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


# Final-answer extraction, written the plain quadratic way: the documented behaviour, as a
# reference for the linear-time extraction in builtin.py on short texts.
def _reference_answers(text):
    boxed = []  # every `\boxed{...}`, braces balanced, in order of start
    for start in range(len(text)):
        if text.startswith("\\boxed{", start):
            depth, begin = 0, start + len("\\boxed{")
            for position in range(begin, len(text)):
                depth += {"{": 1, "}": -1}.get(text[position], 0)
                if depth < 0:
                    boxed.append(text[begin:position])
                    break
    if boxed:
        return boxed
    lines = text.split("\n")  # a marker and its answer sit on one line
    hashes = [line.strip()[4:].strip() for line in lines if line.strip().startswith("####")]
    if hashes := [answer for answer in hashes if answer]:
        return hashes
    answer_is = []
    for line in lines:
        for start in range(len(line)):  # the first `answer is` / `answer:` on the line
            if line[start : start + 6].lower() == "answer":
                rest = line[start + 6 :].lstrip()
                if rest[:2].lower() == "is" or rest[:1] == ":":
                    if answer := rest[2 if rest[:1] != ":" else 1 :].strip():
                        answer_is.append(answer)
                    break
    return answer_is


def _reference_format(response):
    closed = response.rfind("</think>")
    if "<think>" in response and closed == -1:
        return 0.0
    after_thinking = response[closed + len("</think>") :] if closed != -1 else response
    return float(len(_reference_answers(after_thinking)) == 1)


@pytest.mark.parametrize(
    ("text", "answer", "form"),
    [
        ("so \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{}", "", 1.0),
        ("\\boxed{a \\boxed{b} c}", "b", 0.0),  # nested: both count, in order of start
        ("\\boxed{1} then \\boxed{2", "1", 1.0),  # the second never closes
        ("\\boxed{1 {2} \\boxed{3", None, 0.0),
        ("work\n   #### 1,000  \n", "1,000", 1.0),
        ("\t####72\r\n", "72", 1.0),
        ("##### 5", "# 5", 1.0),
        ("#### 1\n\n  #### 2\n", "2", 0.0),
        ("not #### at the start", None, 0.0),
        ("#### 5\nThe answer is 6", "5", 1.0),  # `####` takes precedence
        ("The answer is 42.", "42.", 1.0),
        ("Answer: 1/2", "1/2", 1.0),
        ("ANSWER  IS x", "x", 1.0),
        ("answer is 3, no, the answer is 4", "3, no, the answer is 4", 1.0),  # first per line
        ("The answer is 3.\nSo the answer: 4", "4", 0.0),
        ("<think>The answer is 3</think>\nThe answer is 4", "4", 1.0),
        ("<think>\\boxed{3}</think> \\boxed{4}", "4", 1.0),
        # A marker and its answer sit on one line, and an answer is not only whitespace
        # (versions before linear-time extraction crossed newlines here, or answered " ").
        ("The answer is\n42", None, 0.0),
        ("answer\nis 42", None, 0.0),
        ("####\n42", None, 0.0),
        ("#### \n#### 3", "3", 1.0),
        ("The answer is   ", None, 0.0),
        ("nothing marked", None, 0.0),
    ],
)
def test_final_answer_and_format_follow_the_documented_rules(text, answer, form):
    assert final_answer(text) == answer
    assert format_reward(text) == form
    assert _reference_answers(text)[-1:] == ([] if answer is None else [answer])


def test_numbers_compare_as_numbers_through_extraction():
    assert exact_match("#### 1,000", "1000.0") == 1.0
    assert exact_match("The answer is 0.5", "1/2") == 1.0
    assert exact_match("\\boxed{$12$}.", "12") == 1.0


_TOKENS = ["\\boxed{", "{", "}", "####", "answer", "Answer", " is", "is", ":", "\n", " ", "\t"]
_TOKENS += ["1", "2", "x", ".", "<think>", "</think>", "answer is", "ANSWER:"]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_TOKENS), max_size=40).map("".join))
def test_extraction_matches_the_plain_reference(text):
    answers = _reference_answers(text)
    assert final_answer(text) == (answers[-1] if answers else None)
    assert format_reward(text) == _reference_format(text)


def test_huge_numbers_compare_as_text():
    # int() refuses more than 4300 digits (ValueError); such "numbers" compare as text.
    digits = "9" * 100_000
    assert answers_match(digits, digits)
    assert not answers_match(digits, "9" * 99_999)
    assert not answers_match(digits + ".0", digits)
    assert not answers_match("1/" + "0" * 5000, "1")


_MIB = 1 << 20


# Untrusted responses made to be slow: extraction must take linear time, as a slow regex holds
# the GIL and freezes the whole reward server. Before linear-time extraction most of these took
# from minutes to hours.
@pytest.mark.parametrize(
    ("make_response", "label", "reward"),
    [
        pytest.param(lambda: "\n" * _MIB, "4", 0.0, id="newlines"),
        pytest.param(lambda: "\n " * (_MIB // 2), "4", 0.0, id="newlines-and-spaces"),
        pytest.param(
            lambda: "<think>" + "\n" * _MIB + "</think>\n#### 4", "4", 1.1, id="long-think"
        ),
        pytest.param(
            lambda: ("answer" + " " * 100) * (_MIB // 106) + "answer is 4",
            "4",
            1.1,
            id="answer-then-spaces",
        ),
        pytest.param(
            lambda: "answer is a" + "  b" * (_MIB // 3), "4", 0.1, id="answer-is-many-runs"
        ),
        pytest.param(
            lambda: "answer is a" + (" " * 10_000 + "b") * (_MIB // 10_001),
            "4",
            0.1,
            id="answer-is-long-runs",
        ),
        pytest.param(lambda: "answer is a" + " " * _MIB + "b", "4", 0.1, id="answer-is-one-run"),
        pytest.param(lambda: "#### a" + " " * _MIB + "b", "4", 0.1, id="hashes-one-run"),
        pytest.param(lambda: "#### " * (_MIB // 5), "4", 0.1, id="hashes-repeated"),
        pytest.param(lambda: " #### \n" * (_MIB // 7) + "#### 4", "4", 1.1, id="hash-lines"),
        pytest.param(lambda: "\\boxed{" * (_MIB // 7), "4", 0.0, id="boxed-repeated"),
        pytest.param(lambda: "\\boxed{" + "{" * _MIB, "4", 0.0, id="braces-after-boxed"),
        pytest.param(
            lambda: "\\boxed{" * (_MIB // 16) + "4" + "}" * (_MIB // 16),
            "4",
            1.0,
            id="nested-boxed",
        ),
        pytest.param(lambda: "\\boxed{4}" + "{}" * (_MIB // 2), "4", 1.1, id="balanced-braces"),
        pytest.param(lambda: "\\boxed{" + "7" * 100_000 + "}", "4", 0.1, id="huge-answer"),
        pytest.param(
            lambda: "\\boxed{" + "7" * 100_000 + "}", "7" * 100_000, 1.1, id="huge-answer-and-label"
        ),
        pytest.param(lambda: "\\boxed{4}", "4" * 100_000, 0.1, id="huge-label"),
    ],
)
def test_math_reward_takes_linear_time_on_hostile_responses(make_response, label, reward):
    response = make_response()
    began = time.perf_counter()
    result = math_reward(response, label)
    assert time.perf_counter() - began < 2.0
    assert result["reward"] == reward


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("3 boxes of 12 is 36; she gives away 5, so 36 - 5 = 31 apples.", "31", 1.0),
        ("The total comes to $1,234.50 in all", "1234.5", 1.0),
        ("x = 10-3 = 7", "7", 1.0),  # "-3" is not a number here: 10 minus 3
        ("It fell to -7 degrees", "-7", 1.0),
        ("3,4,5 are the sides", "345", 0.0),  # a list, not 345: the last number is 5
        ("3,4,5 are the sides; the longest is 5", "5", 1.0),
        ("#### 12\nlater I thought 99", "12", 1.0),  # a marked answer wins over the last number
        ("\\boxed{1/2} or 0.7", "0.5", 1.0),
        ("It is 42.", "42.0", 1.0),
        ("no number at all", "4", 0.0),
        ("", "4", 0.0),
    ],
)
def test_number_match_reads_the_final_number_of_free_form_reasoning(response, label, reward):
    assert number_match(response, label) == reward


def test_number_match_needs_a_number_label():
    with pytest.raises(ValueError, match="number_match needs a number as the sample's `label`"):
        number_match("42", "forty-two")


@pytest.mark.parametrize(
    "response",
    [
        "1," * _MIB,
        "9" * _MIB,
        "-" * _MIB,
        "1,234" * (_MIB // 5),
        "1." * _MIB,
        "-1" * _MIB,
        ",000" * (_MIB // 4),
    ],
    ids=["commas", "digits", "minus", "groups", "dots", "minus-ones", "comma-groups"],
)
def test_number_match_takes_linear_time_on_hostile_responses(response):
    began = time.perf_counter()
    number_match(response, "4")
    assert time.perf_counter() - began < 2.0
