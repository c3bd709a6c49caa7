"""Chat-message prompts: rendered with the tokenizer's template, the same way by SFT, reward
models and DPO (and by rlhf-launch's datasets: packages/launcher/tests/test_data.py)."""

import json

import pytest

from ferrule_testkit import tiny_model
from ferrule_trainer.chat import prompt_text
from ferrule_trainer.preference import PreferenceDataConfig, load_pairs
from ferrule_trainer.sft import load_examples

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
RENDERED = "<|system|>Be brief.\n<|user|>2 + 2?\n<|assistant|>"


@pytest.fixture
def chat_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_messages_render_with_the_template_and_text_stays_as_it_is(chat_tokenizer):
    assert prompt_text(chat_tokenizer, MESSAGES, "x") == RENDERED
    assert prompt_text(chat_tokenizer, "plain 2 + 2?", "x") == "plain 2 + 2?"
    assert prompt_text(None, "plain", "x") == "plain"  # text needs no tokenizer


def test_every_trainer_entry_point_renders_messages_the_same_way(tmp_path, chat_tokenizer):
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": MESSAGES, "response": " 4"}) + "\n")
    pair = {"prompt": MESSAGES, "chosen": " 4", "rejected": " 5"}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    sft = load_examples(tmp_path / "sft.jsonl", "prompt", "response", chat_tokenizer)
    pairs = load_pairs(
        tmp_path / "pairs.jsonl",
        PreferenceDataConfig(path=tmp_path / "pairs.jsonl"),
        chat_tokenizer,
    )
    assert sft == [(RENDERED, " 4")] and pairs[0].prompt == RENDERED


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "a prompt is a string or a non-empty list of chat messages, got list"),
        (7, "a prompt is a string or a non-empty list of chat messages, got int"),
        ([{"role": "user"}], "message 1 must be"),
        ([{"role": "narrator", "content": "hi"}], "message 1 must be"),
    ],
)
def test_bad_prompts_are_named(chat_tokenizer, prompt, message):
    with pytest.raises(ValueError, match=f"data.jsonl:4: {message}"):
        prompt_text(chat_tokenizer, prompt, "data.jsonl:4")


def test_messages_without_a_chat_template_are_refused(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": MESSAGES, "response": " 4"}) + "\n")
    with pytest.raises(
        ValueError, match=r"sft.jsonl:1: chat messages need a tokenizer with a chat"
    ):
        load_examples(tmp_path / "sft.jsonl", "prompt", "response", tokenizer)
