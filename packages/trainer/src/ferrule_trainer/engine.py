"""DeepSpeed engines from flat arguments: process group, config, model loading, one optimizer step.

    init_distributed()
    config = deepspeed_config(zero_stage=3, dtype="float32")
    model = load_model(path, dtype="float32", ds_config=config, lora_rank=8)
    engine = build_engine(model, learning_rate=1e-5, ds_config=config)
    metrics = optimizer_step(engine, micro_batches, loss_fn)
    startup_seconds()  # {"imports": 4.1, "distributed": 0.3, "weights": 2.0, "deepspeed": 1.2}

The same code runs on CPU (DeepSpeed's CPU accelerator over gloo, torch AdamW) and on GPUs
(NCCL, torch's fused AdamW below ZeRO-3; see `adam_params`). The actor, critic, reference and
reward model (actor.py, critic.py) are built from these functions; nothing here knows about
losses.
"""

import contextlib
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ferrule_trainer import nonfinite
from ferrule_trainer.config import LORA_TARGETS
from ferrule_trainer.sequences import COMPILED_HEAD, most_over_ranks, without_cudnn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_SPENT: dict[str, float] = {}  # this process's start-up seconds by phase (startup_seconds)


@contextlib.contextmanager
def _timed(phase: str):
    began = time.perf_counter()
    try:
        yield
    finally:
        _SPENT[phase] = _SPENT.get(phase, 0.0) + time.perf_counter() - began


def startup_seconds() -> dict[str, float]:
    """Seconds this process has spent so far in each start-up phase: "imports" (DeepSpeed,
    transformers' auto classes), "distributed" (joining the process group: includes waiting for
    the other ranks), "weights" (`load_model`: the checkpoint read, the model's own module
    imported, LoRA) and "deepspeed" (`build_engine`: deepspeed.initialize, the optimizer's
    creation included). A process that builds several engines gets their sums."""
    return {phase: round(seconds, 2) for phase, seconds in _SPENT.items()}


def on_cpu() -> bool:
    """True when DeepSpeed will use its CPU accelerator (no CUDA device, or DS_ACCELERATOR=cpu)."""
    return os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()


def init_distributed() -> None:
    """Start torch.distributed for DeepSpeed once per process: gloo on CPU, NCCL on GPUs.

    Under a launcher (torchrun, deepspeed, Ray actors that set RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT) this joins that group; without one it starts a group of one on a free port.
    """
    if on_cpu():
        # Must be set before deepspeed is imported: the accelerator is chosen at import time.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with _timed("imports"):
        import deepspeed

    if torch.distributed.is_initialized():
        return
    if on_cpu():
        # On first use, DeepSpeed's CPU backend compiles a shared-memory all-reduce op (with a
        # C++ toolchain, ~25 s on two cores, once per virtualenv) under a lock file in
        # ~/.cache/torch_extensions. A killed build leaves the lock file behind, and every later
        # start then waits on it forever. gloo does the same reduction, and our CPU groups are
        # small.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = "gloo" if on_cpu() else "nccl"
    with _timed("distributed"):
        if "RANK" in os.environ:  # under a launcher that set up the group
            deepspeed.init_distributed(dist_backend=backend)
        else:
            # A group of one, set up by argument rather than through RANK / MASTER_PORT in
            # os.environ: those would leak into every process this one starts (a launcher's Ray
            # actors, say) and point their DeepSpeed at this private group.
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine reads it for a device
            deepspeed.init_distributed(
                dist_backend=backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=1,
                auto_mpi_discovery=False,
            )
    if not on_cpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def device() -> torch.device:
    if on_cpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def check_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def deepspeed_config(
    *,
    zero_stage: int,
    dtype: str,
    train: bool = True,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    max_grad_norm: float = 1.0,
) -> dict[str, Any]:
    """The DeepSpeed config dict for one engine. We do the micro-batching (see
    `optimizer_step`), so DeepSpeed sees one micro-batch per step and we mark the accumulation
    boundary ourselves. A frozen engine (`train` False) has no optimizer to offload. Below
    ZeRO-3 it runs at stage 0, where each rank holds a whole copy; under ZeRO-3 it stays
    sharded."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not train:
        zero_stage, offload_optimizer = (3 if zero_stage == 3 else 0), False
    check_dtype(dtype)
    if offload_params and zero_stage != 3:
        raise ValueError(
            f"offload_params needs zero_stage 3 (got {zero_stage}): only ZeRO-3 shards parameters"
        )
    if offload_optimizer and zero_stage == 0:
        raise ValueError(
            "offload_optimizer needs zero_stage 1, 2 or 3: ZeRO-0 has no optimizer offload"
        )
    if (offload_optimizer or offload_params) and on_cpu():
        raise ValueError(
            "offload_optimizer / offload_params need a GPU: on the CPU accelerator the states "
            "already live in host memory"
        )
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        # Gather a whole layer's parameters at once instead of many small collectives.
        zero.update(
            stage3_param_persistence_threshold=10_000, stage3_prefetch_bucket_size=50_000_000
        )
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # DeepSpeed's bf16 overflow check scans every gradient (six kernels per gradient, then
        # a host sync); it took 45 of the 68 ms optimizer step of a 0.5B Qwen2 on one H100.
        # bf16 needs no loss scaling, and `optimizer_step` skips an update whose gradient norm
        # is not finite.
        "bf16": {"enabled": dtype == "bfloat16", "check_grad_overflow": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train:
        config["gradient_clipping"] = max_grad_norm
    return config


@contextlib.contextmanager
def _partitioned_load(ds_config: dict[str, Any] | None):
    """Under ZeRO-3, transformers partitions the weights while loading (deepspeed.zero.Init), so
    no rank ever holds the full model. The global it sets must not leak into later loads."""
    if ds_config is None or ds_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(ds_config)  # transformers holds only a weakref to it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del keep_alive


def load_model(
    path: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    ds_config: dict[str, Any] | None = None,
    kind: str = "causal-lm",
    gradient_checkpointing: bool = False,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    lora_targets: Sequence[str] = LORA_TARGETS,
    attn_implementation: str | None = None,
    prepare: Callable[[torch.nn.Module], Any] | None = None,
    compile_layers: bool = False,
) -> torch.nn.Module:
    """A Hugging Face model from `path`, ready for `build_engine`.

    kind: "causal-lm" (actor, reference), "value" (critic: one value per token, a linear head on
    the last hidden state, `AutoModelForTokenClassification` with one label) or "reward" (one
    score per sequence, `AutoModelForSequenceClassification` with one label).
    lora_rank > 0 wraps the model with peft LoRA adapters on `lora_targets`; only the adapters
    train. `prepare(model)` runs on the loaded model before checkpointing, LoRA and DeepSpeed
    (the launcher passes ferrule-rollout's exact numerics this way, so the trainer imports none
    of ferrule-rollout). compile_layers runs each decoder layer through torch.compile (see
    `compile_decoder_layers`), on CUDA below ZeRO-3 only; elsewhere the layers run as they are.
    """
    torch_dtype = check_dtype(dtype)
    with _timed("imports"):  # transformers' auto classes import lazily, on first use (~1.5 s)
        import transformers

        classes = {
            "causal-lm": transformers.AutoModelForCausalLM,
            "value": transformers.AutoModelForTokenClassification,
            "reward": transformers.AutoModelForSequenceClassification,
        }
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    config = transformers.AutoConfig.from_pretrained(path)
    if kind != "causal-lm":
        config.num_labels = 1
        # a value head with dropout gives noisy PPO targets (transformers defaults to 0.1 when
        # the config names none)
        config.classifier_dropout = 0.0
    extra: dict[str, Any] = (
        {"attn_implementation": attn_implementation} if attn_implementation else {}
    )
    with _timed("weights"), _partitioned_load(ds_config):
        model = classes[kind].from_pretrained(path, config=config, dtype=torch_dtype, **extra)
    if prepare is not None:
        prepare(model)
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage", 0)
    if compile_layers and not on_cpu() and stage != 3:
        compile_decoder_layers(model)
    if kind != "causal-lm" and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if gradient_checkpointing:
        # the recomputation in backward runs outside the forward's sdpa_kernel block
        kwargs = {"use_reentrant": False, "context_fn": without_cudnn}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        task = {"causal-lm": "CAUSAL_LM", "value": "TOKEN_CLS", "reward": "SEQ_CLS"}[kind]
        lora = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha,
            target_modules=list(lora_targets),
            lora_dropout=0.0,
            task_type=task,
        )
        model = get_peft_model(model, lora)
    return model


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """Runs torch.compile on each decoder layer (the classes the model lists in
    `_no_split_modules`), in place, and returns how many layers it compiled. Inductor fuses the
    norms, rotary, activation and residual kernels between the matmuls: at 1.5B on an H100 those
    small kernels took as long as the matmuls, and compiled layers made a training step 18%
    faster (benchmarks/train_phase_gpu.py). Each layer compiles on its first call, for any
    length (dynamic shapes). The forwards give the layers inputs of one form
    (`sequences.model_inputs`); otherwise a layer would recompile for each new form. ZeRO-3 is
    left out (not tried): its hooks gather every layer's weights inside the forward, and dynamo
    would have to break the graph around them."""
    import torch._dynamo

    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    # every layer instance has its own guards on the shared forward code: one cache entry per
    # layer with gradients and one without (the scoring passes)
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = max(limit, 2 * len(layers) + 8)
    for layer in layers:
        layer.compile(dynamic=True)
    setattr(model, COMPILED_HEAD, True)  # and the LM head's softmax (sequences.response_logprobs)
    return len(layers)


def warmup_cosine(warmup_steps: int, total_steps: int | None, min_lr_ratio: float = 0.1):
    """lr multiplier: linear warm-up, then cosine decay to `min_lr_ratio` (constant if total_steps
    is None). A plain function of the step, so LambdaLR's state is just its step count."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if total_steps is None:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_engine(
    model: torch.nn.Module,
    *,
    zero_stage: int = 2,
    dtype: str = "bfloat16",
    train: bool = True,
    learning_rate: float = 1e-6,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    max_grad_norm: float = 1.0,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    ds_config: dict[str, Any] | None = None,
):
    """A DeepSpeed engine around `model`: trained (AdamW + warm-up/cosine schedule) or frozen.

    A frozen engine (reference, reward model) has no optimizer; under ZeRO-3 its parameters stay
    sharded, other stages keep a full copy per rank. `ds_config` overrides the config that the
    flat arguments give (pass the one used for `load_model` under ZeRO-3).
    """
    import deepspeed

    init_distributed()
    if ds_config is None:
        ds_config = deepspeed_config(
            zero_stage=zero_stage,
            dtype=dtype,
            train=train,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            max_grad_norm=max_grad_norm,
        )
    if not train:
        model.requires_grad_(False)
        with _timed("deepspeed"):
            engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        engine.eval()
        return engine
    zero = ds_config.get("zero_optimization", {})
    adam = adam_params(
        cpu=on_cpu(),
        zero_stage=zero.get("stage", 0),
        offloaded="offload_optimizer" in zero,
        lr=learning_rate,
        betas=list(betas),
        eps=eps,
        weight_decay=weight_decay,
    )
    ds_config = dict(ds_config, optimizer={"type": "AdamW", "params": adam})
    schedule = warmup_cosine(warmup_steps, total_steps)
    with _timed("deepspeed"):
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds_config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        )
    return engine


def adam_params(*, cpu: bool, zero_stage: int, offloaded: bool, **hyper) -> dict[str, Any]:
    """The params of DeepSpeed's "AdamW" optimizer (`hyper`: lr, betas, eps, weight_decay).

    The CPU accelerator uses torch's own AdamW, and so do GPUs under ZeRO 0-2, as torch's fused
    kernel. Left to itself, DeepSpeed would pick its FusedAdam on GPUs: a CUDA extension that
    ninja compiles the first time on each machine, costing tens of seconds of start-up (our GPU
    machines start fresh every time). torch's AdamW steps as fast (57.4k against 56.9k tok/s,
    0.5B ZeRO-2 bf16 on an H100, benchmarks/RESULTS.md). ZeRO-3 keeps FusedAdam, because its
    `offload_states` (the hybrid engine's offload between phases) accepts no other optimizer
    (deepspeed/runtime/zero/stage3.py). Optimizer states offloaded to the host keep DeepSpeed's
    CPU Adam (its own compiled op): ZeRO-Offload has its own code paths for it, and DeepSpeed
    calls any other optimizer there "poor performance" (`zero_force_ds_cpu_optimizer`)."""
    if cpu:
        return dict(hyper, torch_adam=True)
    if offloaded or zero_stage == 3:
        return dict(hyper)
    return dict(hyper, torch_adam=True, fused=True)


def global_sum(value: float | int | torch.Tensor) -> torch.Tensor:
    """Sum over all data-parallel ranks (a float64 tensor on this rank's device)."""
    total = torch.as_tensor(value, dtype=torch.float64, device=device()).clone()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    return total


def optimizer_step(
    engine,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[Any], tuple[torch.Tensor, dict[str, float]]],
    copies: int = 1,
) -> dict[str, float]:
    """One optimizer step over any number of micro-batches.

    `loss_fn(micro_batch)` returns (loss, metrics): the micro-batch's share of the step's loss,
    already divided by the step's global count (see aggregation.aggregate_loss), so that the sum
    over micro-batches and ranks is the step's loss. DeepSpeed averages gradients over ranks,
    so the share is multiplied by the world size before backward. There is no scaling by
    accumulation steps, since we mark the accumulation boundary ourselves. Returns the step's
    loss (summed over ranks), the mean of each metric over micro-batches, the gradient norm and
    the learning rate.

    Every rank runs as many backward passes as the rank with the most micro-batches. Under
    ZeRO-2 each backward reduces gradients across ranks, and under ZeRO-3 each forward gathers
    parameters, but token budgets give ranks different counts of micro-batches. One more pass
    on one rank would be a mismatched collective, which gloo aborts and NCCL waits on forever.
    So a rank with fewer micro-batches repeats its last one with its loss times zero, which
    adds no gradient and no metric.

    An update whose gradients hold a NaN or an inf is skipped on every rank, with nothing
    changed (`_update_unless_nonfinite`). The result then has "skipped" 1.0 (else 0.0) and
    "nonfinite": where `nonfinite.locate` found the values to arise.

    `copies` is how many ranks hold the same loss (all ranks of a sequence group compute their
    group's loss, sequence_parallel.py); the reported loss counts that loss once.
    """
    if not micro_batches:
        raise ValueError("optimizer_step needs at least one micro-batch")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    engine.train()
    # Losses and metrics stay on the device until the step is done: reading one per micro-batch
    # would stall the host and leave the GPU idle while Python launches the next forward.
    total = torch.zeros((), dtype=torch.float64, device=device())
    sums: dict[str, torch.Tensor] = {}
    passes = most_over_ranks(len(micro_batches), device())
    for index in range(passes):
        engine.set_gradient_accumulation_boundary(index == passes - 1)
        if index >= len(micro_batches):
            loss, _ = loss_fn(micro_batches[-1])
            engine.backward(loss * 0.0, scale_wrt_gas=False)
            continue
        loss, metrics = loss_fn(micro_batches[index])
        engine.backward(loss * world, scale_wrt_gas=False)
        total += loss.detach()
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + torch.as_tensor(value).detach().double()
    lr = engine.get_lr()[0]
    # DeepSpeed records the norm in its ZeRO and bf16 optimizers; its plain fp32 path (ZeRO-0)
    # clips without keeping it, so take it here, before the step clears the gradients.
    plain_fp32 = engine.zero_optimization_stage() == 0 and not (
        engine.bfloat16_enabled() or engine.fp16_enabled()
    )
    own_norm = _grad_norm(engine.module) if plain_fp32 else None
    applied = _update_unless_nonfinite(engine, own_norm)
    result = {key: float(value) / len(micro_batches) for key, value in sums.items()}
    result["loss"] = float(global_sum(total)) / copies
    grad_norm = engine.get_global_grad_norm() if own_norm is None else own_norm
    result["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    if applied and grad_norm is not None and not nonfinite.is_finite(grad_norm):
        raise nonfinite.NonFiniteGradientError(  # a DeepSpeed path that skipped nothing
            f"gradient norm is {result['grad_norm']} (loss {result['loss']}) and the update "
            "was applied: training stops before these weights reach a checkpoint or an engine"
        )
    result["skipped"] = 0.0 if applied else 1.0
    if not applied:
        result["nonfinite"] = nonfinite.locate(engine, micro_batches, loss_fn)
    result["lr"] = lr
    return result


def _update_unless_nonfinite(engine, own_norm: float | None) -> bool:
    """Runs engine.step() unless the step's gradients hold a NaN or an inf, and returns whether
    the update was applied. A skipped update changes nothing (weights, optimizer states, the
    learning-rate schedule) and drops the gradients. That is DeepSpeed's own overflow path,
    which DeepSpeed takes by itself under ZeRO-3, in its ZeRO-0 bf16 optimizer and in fp32
    under ZeRO-1/2. In bf16 under ZeRO-1/2 the overflow scan is off (`deepspeed_config`), so
    the norm that DeepSpeed takes for clipping is taken here first, and a non-finite norm turns
    the scan on for this step alone. In fp32 under ZeRO-0 DeepSpeed calls torch's optimizer as
    it is, so `own_norm` decides."""
    if own_norm is not None:
        if not nonfinite.is_finite(own_norm):
            engine.zero_grad()
            return False
        engine.step()
        return True
    optimizer = engine.optimizer
    unguarded = getattr(optimizer, "check_grad_overflow", True) is False and (
        getattr(optimizer, "dtype", None) == torch.bfloat16
    )
    if unguarded and not nonfinite.is_finite(optimizer.scaled_global_norm()):
        optimizer.check_grad_overflow = True
        try:
            engine.step()
        finally:
            optimizer.check_grad_overflow = False
    else:
        engine.step()
    return engine.was_step_applied()


def _grad_norm(module: torch.nn.Module) -> float:
    """The L2 norm of all gradients, before clipping (ZeRO-0: every rank holds the averaged
    gradients once the accumulation boundary's backward has all-reduced them)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
