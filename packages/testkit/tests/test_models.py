"""The kit builds loadable tiny models, deterministically, and reuses its cache."""

import hashlib
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from ferrule_testkit import SPECS, tiny_model, tiny_tokenizer


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != "key.json"
    }


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_model_loads_and_generates(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("FERRULE_CACHE", str(tmp_path))
    path = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer("Question: what is 12 + 30? Answer:", return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    assert out.shape == (1, ids.shape[1] + 5)


def test_tokenizer_round_trips_task_text(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRULE_CACHE", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer())
    text = "Reverse the string hello. Answer: olleh"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2, "BPE learned nothing: one token per character"


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRULE_CACHE", str(tmp_path / "a"))
    first = _digest(tiny_model("qwen2", seed=3))
    monkeypatch.setenv("FERRULE_CACHE", str(tmp_path / "b"))
    second = _digest(tiny_model("qwen2", seed=3))
    assert first == second
    other = _digest(tiny_model("qwen2", seed=4))
    assert other["model.safetensors"] != first["model.safetensors"]


def test_cache_is_reused_and_overrides_are_keyed(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRULE_CACHE", str(tmp_path))
    path = tiny_model("llama")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_model("llama") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    deeper = tiny_model("llama", num_hidden_layers=3)
    assert deeper != path
    assert AutoModelForCausalLM.from_pretrained(deeper).config.num_hidden_layers == 3


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tiny model architecture 'gpt9'"):
        tiny_model("gpt9")


def test_vocab_size_pads_the_embedding_and_head_past_the_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRULE_CACHE", str(tmp_path))
    path = tiny_model("qwen2", vocab_size=1000)
    assert path != tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 512 and model.config.vocab_size == 1000
    assert model.get_input_embeddings().weight.shape == (1000, 128)
    ids = tokenizer("Question: what is 12 + 30? Answer:", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == 1000
    with pytest.raises(ValueError, match="vocab_size 100 is smaller than the kit tokenizer's 512"):
        tiny_model("qwen2", vocab_size=100)
