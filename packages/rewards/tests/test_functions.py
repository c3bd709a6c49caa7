"""Reward functions as a backend, without the network: loading, signatures, per-sample failures."""

import asyncio
import math
import sys
import time

import pytest

from ferrule_rewards.functions import FunctionScorer, load_function, signature_fields
from ferrule_rewards.records import SAMPLE_FIELDS, Status


@pytest.fixture
def scorer(fn_spec):
    """scorer(name, **options) -> a FunctionScorer for a function of tests/reward_fns.py."""
    return lambda name, **options: FunctionScorer(load_function(fn_spec(name)), **options)


def score(scorer: FunctionScorer, rows: list[tuple]):
    return scorer.score(rows)


def test_load_function_by_module_and_by_path(monkeypatch, fn_spec, tests_dir):
    assert load_function("ferrule_rewards.builtin:exact_match").__name__ == "exact_match"
    assert load_function(fn_spec("length"))("abc") == 3.0
    monkeypatch.chdir(tests_dir)  # modules are found from the current directory, as `python -m`
    monkeypatch.delitem(sys.modules, "reward_fns", raising=False)
    assert load_function("reward_fns:length")("ab") == 2.0
    assert load_function("ferrule_rewards.builtin:math_reward.__call__")  # dotted attributes


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("exact_match", "expected 'module:function'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("ferrule_rewards.builtin:nope", "has no 'nope'"),
        ("ferrule_rewards.builtin:re", "not callable"),  # a module, not a function
        ("/nowhere/file.py:f", "no file"),
    ],
)
def test_load_function_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        load_function(spec)


def test_signatures():
    def per_sample(response, label):
        pass

    def keywords(*, label, response):
        pass

    def batch(samples):
        pass

    def everything(**sample):
        pass

    assert signature_fields(per_sample) == (("response", "label"), False, True)
    assert signature_fields(keywords) == (("label", "response"), False, False)
    assert signature_fields(batch) == (SAMPLE_FIELDS, True, True)
    assert signature_fields(everything) == (SAMPLE_FIELDS, False, False)


def test_a_signature_that_fits_neither_form_is_refused():
    def wrong(answer, response):
        pass

    with pytest.raises(TypeError, match=r"parameter\(s\) answer are not sample fields"):
        FunctionScorer(wrong)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        FunctionScorer(lambda response: 1.0, timeout=0)


def test_per_sample_failures_stay_with_their_sample(scorer):
    responses = ["ok", "raise", "nan", "inf", "text", "no-reward-key", "nan-sub-score", "fine"]
    responses.append("huge")  # it failed the whole batch: 32 of 32 samples ERROR
    scores = score(scorer("misbehaving"), [(r,) for r in responses])
    assert scores.rewards[0] == 2.0 and scores.rewards[7] == 4.0
    assert {i: status for i, (status, _) in scores.errors.items()} == {
        1: Status.ERROR,
        2: Status.INVALID_REWARD,
        3: Status.INVALID_REWARD,
        4: Status.INVALID_REWARD,
        5: Status.INVALID_REWARD,
        6: Status.INVALID_REWARD,
        8: Status.INVALID_REWARD,
    }
    messages = {i: message for i, (_, message) in scores.errors.items()}
    assert messages[1].startswith("ValueError: asked to raise (at reward_fns.py:")
    assert "nan" in messages[2] and "inf" in messages[3]
    assert "str 'not a number', expected a number" in messages[4]
    assert "without a 'reward' key" in messages[5]
    assert "sub-score 'part' is nan" in messages[6]
    assert "reward is int 1000000000" in messages[8] and "too large for a float" in messages[8]


def test_keyword_only_and_every_field(scorer):
    scores = score(scorer("keyword_only"), [("4", "4"), ("4", "5")])
    assert scores.rewards == [1.0, 0.0]
    every = scorer("every_field")
    scores = score(every, [("ab", "cde", [1, 2], [3], "x", {"k": "v"})])
    assert scores.rewards == [5.0]
    assert scores.sub_scores == {0: {"tokens": 6.0, "has_label": 1.0, "metadata_keys": 1.0}}


def test_async_functions(scorer):
    scores = score(scorer("async_length", timeout=0.5), [("ab",), ("hang",), ("raise",)])
    assert scores.rewards[0] == 2.0
    assert scores.errors[1][0] == Status.TIMEOUT
    assert scores.errors[2] == (Status.ERROR, scores.errors[2][1])
    assert scores.errors[2][1].startswith("RuntimeError: async raise")


def test_an_async_function_keeps_its_event_loop_from_batch_to_batch(scorer):
    """What a function binds to the loop (here a contended asyncio.Lock; in real functions an
    aiohttp session) must still work in the next batch: one loop for the scorer's life."""
    rows = [("", r, [], [], "", {}) for r in ("ab", "abc", "abcd")]
    for name, batch in (("locked_length", [("ab",), ("abc",), ("abcd",)]), ("locked_batch", rows)):
        fn = scorer(name)
        for _ in range(3):
            scores = score(fn, batch)
            assert scores.errors == {}, scores.errors
            assert scores.rewards == [2.0, 3.0, 4.0]
        fn.close()


def test_batch_functions(scorer):
    rows = [("", r, [], [], "", {}) for r in ("ab", "raise", "abcd")]
    scores = score(scorer("batch_lengths"), rows)
    assert scores.rewards[0] == 2.0 and scores.rewards[2] == 4.0
    assert scores.errors[1][0] == Status.ERROR
    assert score(scorer("async_batch"), rows).rewards == [2.0, 5.0, 4.0]
    wrong = score(scorer("batch_wrong_length"), rows)
    assert set(wrong.errors) == {0, 1, 2}
    assert "returned 1 for 3 samples" in wrong.errors[0][1]


def test_an_async_batch_function_that_hangs_times_out_the_batch():
    async def hang(samples):
        await asyncio.sleep(2)
        return [1.0] * len(samples)

    started = time.monotonic()
    scores = score(FunctionScorer(hang, timeout=0.2), [("",) * 6] * 2)
    assert time.monotonic() - started < 1.0
    assert all(status == Status.TIMEOUT for status, _ in scores.errors.values())
    assert len(scores.errors) == 2


def test_rewards_of_other_number_types_are_accepted():
    values = iter([1, True, 0.5, {"reward": 2, "bonus": 1}])
    scores = score(FunctionScorer(lambda response: next(values)), [("",)] * 4)
    assert scores.rewards == [1.0, 1.0, 0.5, 2.0]
    assert scores.sub_scores == {3: {"bonus": 1.0}}
    assert not scores.errors
    assert math.isfinite(sum(scores.rewards))
