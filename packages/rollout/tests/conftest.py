"""Shared fixtures for the rollout tests."""

import pytest


@pytest.fixture(scope="module")
def vllm_cpu_env():
    """vLLM settings for this 2-core CPU machine: in-process engine core, 1 GiB of KV cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield mp
