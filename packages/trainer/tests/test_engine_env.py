"""Starting the trainer's engines: what the process group leaves in os.environ, what start-up
must not wait on (compiled ops), and where its seconds go."""

import json
import os
import subprocess
import sys

import pytest
import torch


def test_group_of_one_does_not_leak_rank_or_master_port():
    code = (
        "import json, os; from ferrule_trainer import engine; engine.init_distributed(); "
        "import torch.distributed as d; "
        "print(json.dumps([d.get_world_size(), "
        "[k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT') if k in os.environ]]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    world_size, leaked = json.loads(out.stdout.strip().splitlines()[-1])
    assert world_size == 1
    assert leaked == []  # a launcher started from here would otherwise join this private group


def test_cpu_group_needs_no_compiled_op(tmp_path):
    # A build killed mid-way leaves torch's lock file behind; DeepSpeed's CPU backend would wait
    # on it forever before building its shared-memory op. The trainer must not build it at all.
    stale = tmp_path / "deepspeed_shm_comm"  # TORCH_EXTENSIONS_DIR/<op name>
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    code = (
        "from ferrule_trainer import engine; engine.init_distributed(); "
        "import torch.distributed as d; print(d.get_backend())"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "gloo"
    assert not (stale / "deepspeed_shm_comm.so").exists()


def test_adam_is_torchs_own_unless_deepspeed_needs_its_own():
    """No compiled op for the optimizer: DeepSpeed's FusedAdam builds a CUDA extension with ninja
    on each machine's first start; torch's fused AdamW is in the wheel. ZeRO-3 (whose
    offload_states takes FusedAdam only) and offloaded states (DeepSpeed's CPU Adam) keep
    DeepSpeed's pick: no torch_adam."""
    from ferrule_trainer.engine import adam_params

    hyper = {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    for stage in (0, 1, 2, 3):
        cpu = adam_params(cpu=True, zero_stage=stage, offloaded=False, **hyper)
        assert cpu == dict(hyper, torch_adam=True)
    for stage in (0, 1, 2):
        gpu = adam_params(cpu=False, zero_stage=stage, offloaded=False, **hyper)
        assert gpu == dict(hyper, torch_adam=True, fused=True)
    assert adam_params(cpu=False, zero_stage=3, offloaded=False, **hyper) == hyper
    for stage in (1, 2, 3):
        assert adam_params(cpu=False, zero_stage=stage, offloaded=True, **hyper) == hyper


def test_a_frozen_engine_runs_whole_below_zero_3_and_offloads_no_optimizer():
    """deepspeed_config(train=False): a reference or reward scorer has no optimizer and, below
    ZeRO-3, a whole copy on each rank (stage 0); under ZeRO-3 it stays sharded; no clipping."""
    from ferrule_trainer.engine import deepspeed_config

    for stage in (0, 1, 2, 3):
        frozen = deepspeed_config(zero_stage=stage, dtype="float32", train=False)
        assert frozen["zero_optimization"]["stage"] == (3 if stage == 3 else 0)
        assert "gradient_clipping" not in frozen
    # an optimizer offload asked of a frozen engine is dropped, not refused (the actor's
    # reference is built from the policy's keys)
    frozen = deepspeed_config(zero_stage=2, dtype="float32", train=False, offload_optimizer=True)
    assert "offload_optimizer" not in frozen["zero_optimization"]
    assert deepspeed_config(zero_stage=2, dtype="float32")["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_deepspeed_trains_with_torchs_fused_adamw_below_zero_3(stage, monkeypatch):
    """The GPU's optimizer params (torch_adam + fused), run here on torch's CPU fused kernel:
    DeepSpeed hands `fused` to torch.optim.AdamW and ZeRO 0-2 step with it."""
    from ferrule_testkit import tiny_model
    from ferrule_trainer import engine

    real = engine.adam_params
    monkeypatch.setattr(engine, "adam_params", lambda cpu, **kw: real(cpu=False, **kw))
    config = engine.deepspeed_config(zero_stage=stage, dtype="float32")
    model = engine.load_model(tiny_model("qwen2"), dtype="float32", ds_config=config)
    built = engine.build_engine(model, learning_rate=1e-2, ds_config=config)
    adam = built.basic_optimizer
    assert type(adam) is torch.optim.AdamW and adam.defaults["fused"]
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))

    def loss_fn(batch):
        return built(input_ids=batch, labels=batch).loss, {}

    losses = [engine.optimizer_step(built, [ids], loss_fn)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0], losses
    seconds = engine.startup_seconds()
    assert {"imports", "distributed", "weights", "deepspeed"} <= seconds.keys()
    assert seconds["weights"] > 0 and seconds["deepspeed"] > 0


def test_compile_decoder_layers_compiles_each_decoder_layer_and_nothing_else():
    """engine.compile_decoder_layers finds the layers by the model's own `_no_split_modules`
    (Qwen2DecoderLayer here), whatever wraps them, and lets dynamo keep a graph per layer: with
    recompile's default of 8 the layers past the eighth would silently run eagerly."""
    import torch._dynamo
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ferrule_trainer.engine import compile_decoder_layers
    from ferrule_trainer.sequences import compiled_head

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=12,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = Qwen2ForCausalLM(config)
    limit = torch._dynamo.config.cache_size_limit
    try:
        assert compile_decoder_layers(model) == 12
        compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
        assert compiled == list(model.model.layers)
        assert torch._dynamo.config.cache_size_limit >= 2 * 12
        assert compiled_head(model)  # response_logprobs compiles the head's softmax too
    finally:
        torch._dynamo.config.cache_size_limit = limit
