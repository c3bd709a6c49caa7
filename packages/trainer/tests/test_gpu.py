"""The trainer on a GPU: ZeRO-2 and ZeRO-3 in bf16 over NCCL, the hybrid engine's offload between
steps, and optimizer states and weights kept in host memory (offload_optimizer, offload_params).

Skipped without a CUDA GPU (see the root conftest.py); run on the GPU machines, with results
recorded in benchmarks/RESULTS.md. Each run is its own process: DeepSpeed keeps global state.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
WORKER = Path(__file__).with_name("gpu_hybrid_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A Qwen2 big enough that its states dwarf CUDA's bookkeeping (~60M parameters)."""
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def train(model_dir, tmp_path, stage: int, mode: str) -> tuple[dict, dict]:
    out = tmp_path / f"stage{stage}-{mode}.json"
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0")  # DeepSpeed's op builder rejects "9.0a"
    env.pop("RANK", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(model_dir), str(stage), mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), torch.load(f"{out}.pt")


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_between_steps_frees_the_gpu_and_changes_nothing(model_dir, tmp_path, stage):
    plain, plain_weights = train(model_dir, tmp_path, stage, "plain")
    hybrid, hybrid_weights = train(model_dir, tmp_path, stage, "hybrid")

    assert plain["losses"][-1] < plain["losses"][0]  # it trains
    # offloading moved weights, gradients, master weights and Adam moments off the GPU: what
    # stays is cuBLAS's workspaces (32 MiB per stream that ran a matmul), whatever the model
    for resident, offloaded in zip(hybrid["resident"], hybrid["after_offload"], strict=True):
        assert offloaded <= 80 * 2**20 < resident / 5, (resident, offloaded)
    # ... brought them all back ...
    for resident, reloaded in zip(hybrid["resident"], hybrid["after_reload"], strict=True):
        assert reloaded >= 0.95 * resident, (resident, reloaded)
    # ... and training went on exactly as without it.
    assert hybrid["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert hybrid_weights.keys() == plain_weights.keys()
    for name, tensor in plain_weights.items():
        assert torch.equal(hybrid_weights[name], tensor), name


@pytest.mark.parametrize("stage", [2, 3])
def test_states_in_host_memory_train_like_states_on_the_gpu(model_dir, tmp_path, stage):
    """offload_optimizer (and offload_params under ZeRO-3): DeepSpeed's CPU Adam steps the fp32
    master weights in host memory. Same losses as on the GPU, up to the two Adams' rounding."""
    plain, plain_weights = train(model_dir, tmp_path, stage, "plain")
    on_host, host_weights = train(model_dir, tmp_path, stage, "cpu-states")

    assert on_host["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-6)  # same start
    assert on_host["losses"] == pytest.approx(plain["losses"], rel=1e-2)
    assert on_host["losses"][-1] < on_host["losses"][0]
    # master weights and Adam moments (12 of the 14-16 bytes per parameter) are off the GPU
    assert max(on_host["resident"]) < 0.5 * min(plain["resident"])
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(host_weights[name], tensor, rtol=0.05, atol=2e-3)
