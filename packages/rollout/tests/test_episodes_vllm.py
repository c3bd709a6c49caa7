"""The multi-turn runner on VLLMEngine (vLLM, CPU): turns go to the engine as they come, from
several calls at once, and the episodes' masks and logprobs match a transformers forward."""

import sys
from pathlib import Path

import torch

from ferrule_rollout import SamplingSettings
from ferrule_rollout.episodes import run_episodes
from ferrule_testkit import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from episode_helpers import TwoTurns
from rollout_helpers import LOGPROB_ATOL


def test_two_turn_episodes_on_vllm(vllm_cpu_env):
    from transformers import AutoModelForCausalLM

    from ferrule_rollout.vllm_engine import VLLMEngine

    prompts = ["Question: what is 12 + 30? Answer:", "a", "x y z", "The cat sat"] * 4
    with VLLMEngine(tiny_model("qwen2"), dtype="float32", max_model_len=256) as engine:
        episodes = run_episodes(
            engine, TwoTurns, prompts, SamplingSettings(temperature=0.7, max_tokens=10)
        )
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32).eval()
    for e in episodes:
        assert (e.finish_reason, e.turns, e.rewards) == ("done", 2, [0.25, 1.0])
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(e.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits / 0.7, -1)
        expected = expected.gather(1, torch.tensor(e.response_ids)[:, None])[:, 0]
        mask = torch.tensor(e.mask, dtype=torch.bool)
        assert 0 < int(mask.sum()) < len(e.mask)
        torch.testing.assert_close(
            torch.tensor(e.logprobs)[mask], expected[mask], atol=LOGPROB_ATOL, rtol=0
        )
