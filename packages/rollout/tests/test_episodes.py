"""The multi-turn runner on the transformers engine and the kit model: masks, logprobs and token
ids of two-turn episodes against a transformers forward, failures by reason (an environment
that raises, hangs or returns garbage; a tool that hangs, raises or returns garbage), the
failed-fraction check, and observation rendering with a chat template."""

import sys
import time
from pathlib import Path

import pytest
import torch

from ferrule_rollout import SamplingSettings
from ferrule_rollout.environments import EpisodeBudget
from ferrule_rollout.episodes import (
    EpisodeFailuresError,
    check_failures,
    failure_counts,
    observation_ids,
    run_episodes,
)
from ferrule_testkit import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from episode_helpers import Scripted, TwoTurns

TEMPERATURE = 0.7
SETTINGS = SamplingSettings(temperature=TEMPERATURE, max_tokens=10)
PROMPTS = ["Question: what is 12 + 30? Answer:", "Reverse the string hello.", "a", "x y z"]


@pytest.fixture(scope="module")
def engine():
    from ferrule_rollout.hf_engine import TransformersEngine

    with TransformersEngine(tiny_model("qwen2"), dtype="float32", max_model_len=256) as engine:
        yield engine


class Recording:
    """The engine, keeping every prompt it was sent and every sample it returned."""

    def __init__(self, engine):
        self.engine, self.prompts, self.samples = engine, [], []
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len

    def generate(self, prompts, settings):
        samples = self.engine.generate(prompts, settings)
        self.prompts += [list(p) for p in prompts]
        self.samples += samples
        return samples


def test_two_turn_episodes_match_a_transformers_forward(engine):
    from transformers import AutoModelForCausalLM

    recording = Recording(engine)
    episodes = run_episodes(recording, TwoTurns, PROMPTS * 2, SETTINGS)
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32).eval()
    tok = engine.tokenizer
    observation = tok.encode(" Observation: the answer is 42.", add_special_tokens=False)
    round_trip_changes = 0
    for e in episodes:
        assert (e.finish_reason, e.failure, e.turns, e.rewards) == ("done", None, 2, [0.25, 1.0])
        assert e.prompt_ids == tok.encode(PROMPTS[e.index % len(PROMPTS)])
        # The model's tokens exactly as sampled, then the observation's, then the model's again:
        # turn 2's prompt is the whole history, and turn 1's tokens are a sample of the prompt.
        (second_turn,) = [
            s
            for s in recording.samples
            if s.prompt_token_ids[-len(observation) :] == observation
            and s.prompt_token_ids
            == e.prompt_ids + e.response_ids[: len(s.prompt_token_ids) - len(e.prompt_ids)]
        ]
        first = second_turn.prompt_token_ids[len(e.prompt_ids) : -len(observation)]
        second = second_turn.token_ids
        assert first in [
            s.token_ids for s in recording.samples if s.prompt_token_ids == e.prompt_ids
        ]
        assert e.response_ids == first + observation + second
        assert e.mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
        assert e.versions == [0] * len(first) + [-1] * len(observation) + [0] * len(second)
        assert e.prompt_ids + first + observation in recording.prompts
        round_trip_changes += tok.encode(tok.decode(first), add_special_tokens=False) != first
        # Logprobs of the model's tokens: a plain forward over the same ids at the temperature.
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(e.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits / TEMPERATURE, -1).gather(
            1, torch.tensor(e.response_ids)[:, None]
        )[:, 0]
        mask = torch.tensor(e.mask, dtype=torch.bool)
        got = torch.tensor(e.logprobs)
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=0)
        assert not got[~mask].any()  # 0.0 on environment tokens
        # As one sample for scoring and training: the transcript is its response.
        sample = e.sample()
        assert (sample.prompt_token_ids, sample.token_ids) == (e.prompt_ids, e.response_ids)
        assert (sample.mask, sample.logprobs, sample.version) == (e.mask, e.logprobs, 0)
        assert sample.text == e.text == tok.decode(e.response_ids, skip_special_tokens=True)
        # the first turn's reward at its last token; the last turn's is the score's
        assert e.turn_ends == [len(first) - 1, len(e.response_ids) - 1]
        assert sample.turn_rewards == [(len(first) - 1, 0.25)]
    # A decode / encode round trip would have changed some of these turns' ids.
    assert round_trip_changes > 0


def test_failures_fail_their_episode_only(engine):
    modes = [
        "ok",
        "calculator",
        "raise",
        "hang",
        "garbage",
        "bad_reset",
        "tool:hang",
        "tool:junk",
        "tool:boom",
        "ok",
    ]
    start = time.monotonic()
    episodes = run_episodes(
        engine,
        Scripted,
        ["Hello"] * len(modes),
        SETTINGS,
        metadata=[{"mode": m} for m in modes],
        step_timeout=4.0,
    )
    assert time.monotonic() - start < 60  # neither the hung step nor the hung tool held the run
    got = {m: (e.failure, e.finish_reason) for m, e in zip(modes, episodes, strict=True)}
    assert got == {
        "ok": (None, "done"),
        "calculator": (None, "done"),
        "raise": ("env_error", "failed"),
        "hang": ("env_timeout", "failed"),
        "garbage": ("env_bad_output", "failed"),
        "bad_reset": ("env_bad_output", "failed"),
        "tool:hang": ("tool_timeout", "failed"),
        "tool:junk": ("tool_bad_output", "failed"),
        "tool:boom": ("tool_error", "failed"),
    }
    calculator = episodes[1]
    assert calculator.turns == 2 and "42" in engine.tokenizer.decode(
        [t for t, m in zip(calculator.response_ids, calculator.mask, strict=True) if not m]
    )
    assert "KeyError" in episodes[2].detail and "killed" in episodes[6].detail
    counts = failure_counts(episodes)
    assert sum(counts.values()) == 7 and counts["tool_timeout"] == 1
    check_failures(episodes, Scripted, max_failed_fraction=0.7)  # 7 of 10: not more than 0.7
    with pytest.raises(
        EpisodeFailuresError, match=r"environment episode_helpers:Scripted: 7 of 10"
    ):
        check_failures(episodes, Scripted, max_failed_fraction=0.5)


def test_budget_ends_episodes(engine):
    episodes = run_episodes(
        engine, TwoTurns, PROMPTS, SETTINGS, budget=EpisodeBudget(max_turns=1, max_tokens=100)
    )
    assert {(e.finish_reason, e.turns, len(e.rewards)) for e in episodes} == {("max_turns", 1, 1)}
    short = run_episodes(engine, TwoTurns, PROMPTS, SETTINGS, budget=EpisodeBudget(8, 14))
    for e in short:  # 10 model tokens, then a 9-token observation does not fit in 14
        assert (e.finish_reason, e.turns, len(e.response_ids)) == ("max_tokens", 1, 10)


def test_chat_messages_render_after_the_assistant_turn(engine):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    tok.chat_template = (
        "{% for m in messages %}<|pad|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}"
    )
    message = [{"role": "tool", "content": "42"}]
    rendered = "<|pad|>tool\n42<|endoftext|>\n<|pad|>assistant\n"
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert observation_ids(tok, message, first=False, after_eos=True) == encode("\n" + rendered)
    assert observation_ids(tok, message, first=False) == encode("<|endoftext|>\n" + rendered)
    assert observation_ids(tok, message, first=True) == encode(rendered)
    tok.chat_template = None
    assert observation_ids(tok, message, first=False) == encode("\ntool: 42\nassistant:")
