"""The memory estimate: a model's shape read from its folder, and the peaks the phases reach,
against what benchmarks/memory_gpu.py measured at 1.5B on an H100."""

import json

import pytest
from transformers import AutoModelForCausalLM

from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model
from ferrule_trainer import memory
from ferrule_trainer.memory import GiB, ModelShape

QWEN25 = ModelShape(
    parameters=1_543_714_304, layers=28, hidden=1536, intermediate=8960, vocab=151_936, kv_width=256
)

# benchmarks/memory_gpu.py on nvidia-h100-x1, 2026-11-27 at bcdec68 (the LM head on chunks of
# tokens, torch's fused AdamW): torch's peak reserved GiB of one process.
# (zero stage, checkpointing, tokens, response share, train) -> GiB
MEASURED = [
    ((2, True, 8192, 0.75, True), 37.57),
    ((2, False, 8192, 0.75, True), 55.12),
    ((2, False, 12288, 0.75, True), 62.40),
    ((2, True, 32768, 0.75, True), 42.64),
    ((0, True, 8192, 0.75, True), 32.15),
    ((0, False, 4096, 0.75, True), 39.45),
    ((0, False, 16384, 0.75, False), 5.69),
    ((0, False, 32768, 0.75, False), 6.54),
]


def estimate(stage, checkpointing, tokens, share, train) -> float:
    if not train:
        return memory.forward_peak(QWEN25, "bfloat16", tokens, share) / GiB
    peak = memory.policy_train_peak(
        QWEN25,
        dtype="bfloat16",
        zero_stage=stage,
        ranks=1,
        checkpointing=checkpointing,
        tokens=tokens,
        response_share=share,
    )
    return peak / GiB


@pytest.mark.parametrize(("case", "measured"), MEASURED)
def test_the_estimate_is_within_15_percent_of_the_measured_peaks(case, measured):
    assert estimate(*case) == pytest.approx(measured, rel=0.15)


def test_the_shape_and_parameter_count_come_from_the_folder(tmp_path):
    path = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path)
    shape = ModelShape.read(path)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden) == (
        model.config.num_hidden_layers,
        model.config.hidden_size,
    )
    # no weights yet (a config alone): counted from the config, biases aside
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    assert ModelShape.read(tmp_path).parameters == pytest.approx(shape.parameters, rel=0.02)


def test_qwen25_15b_counts_as_its_published_size(tmp_path):
    config = dict(model_type="qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.read(tmp_path)
    assert shape.parameters == pytest.approx(1.54e9, rel=0.01)  # its q/k/v biases aside
    assert shape.kv_width == 2 * 128


def test_a_folder_that_is_not_a_decoder_lm_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match=r"config.json has no 'num_hidden_layers'"):
        ModelShape.read(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN25_1_5B, vocab_size=10)))
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match=r"model.safetensors: not a safetensors file"):
        ModelShape.read(tmp_path)


def test_what_each_setting_saves():
    def state(**kw):
        options = dict(dtype="bfloat16", zero_stage=2, ranks=8) | kw
        return sum(memory.training_state(QWEN25, **options))

    # sharding over 8 ranks: ZeRO-1 the optimizer, ZeRO-2 the gradients too, ZeRO-3 everything
    assert state(zero_stage=0) > state(zero_stage=1) > state(zero_stage=2) > state(zero_stage=3)
    assert state(offload_optimizer=True) < state()
    assert state(zero_stage=3, offload_params=True) < state(zero_stage=3)
    assert state(lora=True) == QWEN25.parameters * 2
    assert state(dtype="float32", zero_stage=0) < state(zero_stage=0) * 2  # no master copy
    plain = memory.train_activations(QWEN25, 8192, 0.75, checkpointing=False)
    checkpointed = memory.train_activations(QWEN25, 8192, 0.75, checkpointing=True)
    assert checkpointed < plain / 2
    # held whole (ZeRO-3), the LM head's logits are most of a checkpointed micro-batch at a 150k
    # vocabulary; on chunks of tokens they are a fixed ~2.3 GiB
    whole = memory.train_activations(QWEN25, 8192, 0.75, checkpointing=True, whole_logits=True)
    no_head = memory.train_activations(QWEN25, 8192, 0.0, checkpointing=True, whole_logits=True)
    assert no_head < whole / 5
    assert checkpointed < whole / 3
    longer = memory.train_activations(QWEN25, 16384, 0.75, checkpointing=True)
    assert longer - checkpointed < 2 * (no_head - 0)
    assert memory.frozen_weights(QWEN25, "bfloat16", 3, 4) < memory.frozen_weights(
        QWEN25, "bfloat16"
    )


def test_activations_grow_with_tokens_and_the_state_does_not():
    """Past the gradients' size (which fill as the activations go) the peak grows by the
    activations alone; below it the gradients set the peak."""
    small, large = (estimate(2, True, tokens, 1.0, True) for tokens in (65536, 131072))
    resident = sum(memory.training_state(QWEN25, dtype="bfloat16", zero_stage=2, ranks=1))
    assert large - small == pytest.approx(
        memory.FRAGMENTATION_CHECKPOINTED
        * (
            memory.train_activations(QWEN25, 131072, 1.0, checkpointing=True)
            - memory.train_activations(QWEN25, 65536, 1.0, checkpointing=True)
        )
        / GiB,
        rel=1e-6,
    )
    assert small * GiB > resident
    tiny, smaller = (estimate(2, True, tokens, 1.0, True) for tokens in (256, 512))
    assert tiny == smaller  # both under the gradients


def test_planning_imports_neither_torch_nor_deepspeed():
    """The launcher plans before any process starts: json and pydantic only."""
    import subprocess
    import sys

    code = (
        "import sys, ferrule_trainer.memory, ferrule_trainer.config; print(' '.join(sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert not {"torch", "deepspeed", "transformers"} & set(loaded.stdout.split())
