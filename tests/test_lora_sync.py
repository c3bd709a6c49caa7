"""A LoRA policy's weights reach a real vLLM engine merged: after a sync through weightsync, the
engine's log-probabilities are those of a transformers forward pass of the merged model the
policy saves, and the adapter it saves beside it gives the same model on top of the base."""

import os
import socket
import threading

import torch

from ferrule_testkit import tiny_model

PROMPTS = ["Reverse the string abc. Answer:", "Question: what is 12 + 30? Answer:"]
# vLLM (float32, CPU) against transformers on the same weights differ by kernel rounding only
# (~1e-6, measured in ferrule-rollout's tests); an adapter left out or merged wrongly moves the
# log-probabilities of these lora_B values by ~0.1 or more.
ATOL = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def teacher_forced_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def test_engine_logprobs_after_a_lora_sync_equal_the_merged_model(tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ferrule_rollout import SamplingSettings
    from ferrule_rollout.vllm_engine import VLLMEngine
    from ferrule_trainer.actor import Actor
    from ferrule_weightsync import create_sender

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    base = tiny_model("qwen2")
    actor = Actor(base, zero_stage=0, dtype="float32", learning_rate=1e-3, lora_rank=4)
    with torch.no_grad():  # peft starts B at 0 (no change): make the adapter matter
        g = torch.Generator().manual_seed(0)
        for name, param in actor.module.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=g))
    with VLLMEngine(base, dtype="float32", max_model_len=256) as engine:
        port, joined = free_port(), {}
        joining = threading.Thread(
            target=lambda: joined.update(sender=create_sender("ipc", "127.0.0.1", port, 1)),
        )
        joining.start()
        engine.init_weight_sync("ipc", "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
        joining.join(60)
        sender, sent = joined["sender"], {}
        sending = threading.Thread(
            target=lambda: sent.update(
                version=sender.send(actor.export_weights(), version=1, specs=actor.weight_specs())
            )
        )
        sending.start()
        assert engine.update_weights(timeout=60) == 1
        sending.join(60)
        sender.close()
        assert sent["version"] == 1
        settings = SamplingSettings(n=2, temperature=1.0, max_tokens=8, seed=5)
        samples = engine.generate(PROMPTS, settings)

    actor.save_hf(tmp_path / "policy")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    untouched = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moved = 0.0
    for sample in samples:
        got = torch.tensor(sample.logprobs)
        expected = teacher_forced_logprobs(merged, sample.prompt_token_ids, sample.token_ids)
        assert torch.allclose(got, expected, atol=ATOL), (got - expected).abs().max()
        before = teacher_forced_logprobs(untouched, sample.prompt_token_ids, sample.token_ids)
        moved = max(moved, float((got - before).abs().max()))
    assert moved > 0.05  # the engine really runs the adapted weights, not the base ones

    adapter = tmp_path / "policy" / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    stacked = PeftModel.from_pretrained(untouched, adapter).eval()
    ids = torch.tensor([samples[0].prompt_token_ids + samples[0].token_ids])
    with torch.no_grad():
        torch.testing.assert_close(stacked(ids).logits, merged(ids).logits, atol=1e-4, rtol=0)
