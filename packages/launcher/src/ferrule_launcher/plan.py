"""The memory plan of a GPU run, made from the config before any process starts. It says what
each GPU holds while the engines generate and while the trainer trains, chooses the [trainer]
keys left "auto" as the fastest plan that fits, and gives a refusal naming the keys when nothing
fits.

    plan = make_plan(config)            # None for a CPU run ([ray] gpus_per_role = 0)
    print(plan.describe())              # rlhf-launch CONFIG --plan
    plan.trainer                        # [trainer] with the "auto" keys chosen

Each role's bytes come from ferrule_trainer.memory (fitted to peaks measured at 1.5B), assuming
the worst micro-batch, in which every token is a response token. A process keeps what its
allocator once reserved. So a policy rank holds its training peak in every phase, unless
offload_between_phases moves its states out, or the engines sleep while it trains (the loop
then has the rank give its cache back before the engines wake). An engine gives its memory back
only with sleep_between_phases.

Host memory is planned too, per node: what the trained models offload there, and each process's
own bytes. DeepSpeed's CPU Adam holds fp32 master weights, both Adam moments and fp32 gradients
(16 bytes a parameter, split over the ranks); offload_params adds the bf16 weights;
offload_between_phases parks the GPU states there while the engines generate. A plan whose node
cannot hold all this does not fit, whatever its GPUs hold.
"""

import itertools
import math
import subprocess
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ferrule_trainer import TrainerConfig, memory
from ferrule_trainer.config import AUTO_KEYS
from ferrule_trainer.memory import GiB, ModelShape

if TYPE_CHECKING:
    from ferrule_launcher.config import Config

CONTEXT = int(0.6 * GiB)  # the CUDA context and libraries of each process on a GPU
# The share of a GPU's memory the plan may fill. The rest is for the estimate's error (within 7%
# where measured), NCCL's buffers and what no estimate sees.
HEADROOM = 0.9
TOKEN_CHOICES = (32768, 16384, 8192, 4096, 2048, 1024, 512)
ENGINE_OVERHEAD = int(0.7 * GiB)  # the transformers engine's prefill activations and graphs
# A policy whose states left the GPU and came back reserves more at its peak: measured 1.2x at
# 1.5B (benchmarks/step_gpu.py, 2026-11-27: 70.1 GiB in use while training against 59.9 planned).
RELOADED = 1.2

# Host memory: each process's own bytes (torch, CUDA's host side, transformers, DeepSpeed; an
# allowance, not measured on a GPU machine), and the share of a node's memory the plan may fill
# (the page cache of the model files, the OS and Ray's object store live in the rest).
PROCESS_HOST = 3 * GiB
HOST_HEADROOM = 0.8
OFFLOADED_OPTIMIZER = 16  # bytes a parameter: fp32 master, Adam's two moments, fp32 gradients
DEFAULT_GPUS_PER_NODE = 8  # where neither [ray] gpus_per_node nor this machine says

# Seconds, from benchmarks/train_phase_gpu.py's timings of a whole step at 1.5B on an H100
# (2026-11-27: 8.73 s at 8k-token micro-batches, 8.14 s at 12k, no checkpointing). A trained
# token costs 6 N flops at ~360 TFLOP/s, more where small micro-batches leave the GPU idle
# (1 + 2,000 / tokens). Checkpointing recomputes the forward (1.2x measured), ZeRO-3 gathers the
# weights every pass, and offloaded optimizer states step on the CPU. Moving the states out and
# back between phases goes through host memory at ~10 GB/s each way.
SECONDS_PER_FLOP = 2.8e-15
IDLE_TOKENS = 2_000
CHECKPOINTING_COST = 1.2
STAGE_COST = {0: 1.1, 1: 1.0, 2: 1.0, 3: 3.0}
HOST_BYTES_PER_S = 10e9
# With several ranks, ZeRO-2 and -3 reduce each micro-batch's gradients across the ranks. NCCL
# between the launcher's Ray actors reduce-scatters a 1.5B model's bf16 gradient in 7.0 ms,
# ~440 GB/s (benchmarks/nccl_ray.py, four H200s, 2026-11-28), and a step's micro-batches took as
# long on each of four ranks as on one GPU. An earlier fit, 18 GB/s, came from timed steps in
# which compiled layers recompiled (sequences.ALIGN), and it made the plan turn on
# checkpointing on several GPUs for nothing.
REDUCE_BYTES_PER_S = 400e9


def seconds(trainer: TrainerConfig, config: "Config", shape: ModelShape) -> float:
    """A step's estimated seconds of training, scoring and moving states on one GPU under
    `trainer`'s memory keys (generation does not depend on them)."""
    t, r = trainer, config.rollout
    step_tokens = r.prompts_per_step * r.samples_per_prompt * r.max_model_len / t.ranks
    train_tokens, forward_tokens = _pass_tokens(t, r.max_model_len)
    flop = SECONDS_PER_FLOP * shape.parameters * step_tokens
    train = 6 * flop * (1 + IDLE_TOKENS / train_tokens)
    train *= (CHECKPOINTING_COST if t.gradient_checkpointing else 1.0) * STAGE_COST[t.zero_stage]
    train *= (5.0 if t.offload_optimizer else 1.0) * (2.0 if t.offload_params else 1.0)
    if t.ranks > 1 and t.zero_stage >= 2 and not t.lora_rank:  # adapters' gradients are small
        micro_batches = math.ceil(step_tokens / train_tokens)
        train += micro_batches * shape.weights(config.model.dtype) / REDUCE_BYTES_PER_S
    passes = (t.kl_coef > 0) + t.needs_old_logprobs()
    forward = 2 * flop * (1 + IDLE_TOKENS / forward_tokens) * passes
    moved = 0.0
    if t.offload_between_phases:
        resident, gradients = memory.training_state(
            shape, dtype=config.model.dtype, zero_stage=t.zero_stage, ranks=t.ranks
        )
        moved = 2 * (resident + gradients) / HOST_BYTES_PER_S
    return train + forward + moved


@dataclass(frozen=True)
class Holding:
    """One process on a GPU: its bytes while the engines generate and while the trainer trains."""

    role: str
    generate: int
    train: int
    how: str  # what the bytes are, for --plan


@dataclass(frozen=True)
class Machine:
    """What the plan needs to know about the machines: one GPU's memory and one node's host
    memory (bytes), and one node's GPU count; None means unknown. [ray] gpu_memory_gb,
    host_memory_gb and gpus_per_node take precedence over these."""

    gpu_memory: int | None
    host_memory: int | None = None
    gpus_per_node: int | None = None

    @classmethod
    def this_one(cls) -> "Machine":
        sizes = gpu_sizes()
        return cls(min(sizes) if sizes else None, host_memory(), len(sizes) or None)


@dataclass(frozen=True)
class HostNeed:
    """One node's host memory in the plan: bytes and what they are."""

    bytes: int
    how: str


@dataclass(frozen=True)
class Plan:
    trainer: TrainerConfig  # with the "auto" keys chosen
    gpus: list[list[Holding]]  # the processes of each distinct GPU (rank 0's bundles)
    memory: int | None  # bytes of one GPU (None: unknown)
    host: HostNeed | None = None  # the fullest node's host memory
    host_memory: int | None = None  # bytes of one node's host memory (None: unknown)

    def host_fits(self) -> bool:
        return (
            self.host is None
            or self.host_memory is None
            or (self.host.bytes <= HOST_HEADROOM * self.host_memory)
        )

    def peak(self) -> tuple[int, str, int]:
        """(bytes, phase, GPU index) of the fullest GPU in its fullest phase."""
        return max(
            (sum(getattr(h, phase) for h in gpu), phase, index)
            for index, gpu in enumerate(self.gpus)
            for phase in ("generate", "train")
        )

    def gpu_fits(self) -> bool:
        return self.memory is None or self.peak()[0] <= HEADROOM * self.memory

    def fits(self) -> bool:
        return self.gpu_fits() and self.host_fits()

    def describe(self) -> str:
        lines = []
        chosen = self.trainer.auto
        keys = ", ".join(
            f"{key} = {getattr(self.trainer, key)}" + (" (auto)" if key in chosen else "")
            for key in AUTO_KEYS
        )
        if self.trainer.kl_coef > 0:
            auto = " (auto)" if self.trainer.reference_ranks_auto else ""
            keys += f", reference_ranks = {self.trainer.reference_ranks}{auto}"
        lines.append(f"[trainer] {keys}")
        size = f"{self.memory / GiB:.1f} GiB" if self.memory else "unknown size"
        lines.append(f"per GPU ({size}; the plan fills at most {HEADROOM:.0%}):")
        for index, gpu in enumerate(self.gpus):
            lines.append(f"  GPU {index}:")
            for h in gpu:
                lines.append(
                    f"    {h.role:<12} generate {h.generate / GiB:6.1f} GiB  train "
                    f"{h.train / GiB:6.1f} GiB  ({h.how})"
                )
            for phase in ("generate", "train"):
                total = sum(getattr(h, phase) for h in gpu)
                lines.append(f"    {'total':<12} {phase} {total / GiB:.1f} GiB")
        peak, phase, index = self.peak()
        verdict = "fits" if self.gpu_fits() else "does NOT fit"
        lines.append(f"peak: {peak / GiB:.1f} GiB on GPU {index}, {phase} phase: {verdict}")
        if self.host is not None:
            of = (
                f"of {HOST_HEADROOM:.0%} x {self.host_memory / GiB:.0f} GiB"
                if self.host_memory
                else "(host memory unknown: set [ray] host_memory_gb)"
            )
            verdict = "fits" if self.host_fits() else "does NOT fit"
            lines.append(
                f"host memory per node: {self.host.bytes / GiB:.1f} GiB {of} ({self.host.how}): "
                f"{verdict}"
            )
        return "\n".join(lines)


def gpu_sizes() -> list[int]:
    """Each GPU's memory on this machine in bytes, from nvidia-smi (none: no NVIDIA GPU here)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return [int(float(line)) * 2**20 for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def host_memory() -> int | None:
    """This machine's memory in bytes, from /proc/meminfo (None: not Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# -- what each process holds ---------------------------------------------------------------------


def _pass_tokens(trainer: TrainerConfig, max_model_len: int) -> tuple[int, int]:
    """The tokens of the largest training micro-batch and of the largest scoring pass. Each is
    its token budget, or its rows x max_model_len where that is less (or no budget is set), but
    never less than one row of max_model_len, as a row longer than the budget goes alone."""

    def tokens(limit: int | None, rows: int) -> int:
        most = rows * max_model_len
        return most if limit is None else max(min(limit, most), max_model_len)

    train = tokens(trainer.micro_batch_tokens, trainer.micro_batch_size)
    forward = tokens(
        trainer.forward_batch_tokens or trainer.micro_batch_tokens,
        trainer.forward_batch_size or trainer.micro_batch_size,
    )
    return train, forward


def holdings(
    config: "Config", trainer: TrainerConfig, shape: ModelShape, gpu_bytes: int | None
) -> list[list[Holding]]:
    """What each process holds on each distinct GPU (`gpu_bytes`: one GPU's memory, from which
    vLLM takes its share)."""
    r, ray, dtype = config.rollout, config.ray, config.model.dtype
    train_tokens, forward_tokens = _pass_tokens(trainer, r.max_model_len)
    # Each rank of a sequence group holds the activations of 1/N of the positions. The all-to-alls
    # swap pieces of equal size: the gathered heads of the whole sequence are 1/N of its width.
    shared = trainer.sequence_parallel
    train_tokens, forward_tokens = -(-train_tokens // shared), -(-forward_tokens // shared)
    lora = trainer.lora_rank > 0
    state_keys = dict(
        dtype=dtype,
        zero_stage=trainer.zero_stage,
        ranks=trainer.ranks,
        offload_optimizer=trainer.offload_optimizer,
        offload_params=trainer.offload_params,
    )
    trained = dict(
        state_keys,
        checkpointing=trainer.gradient_checkpointing,
        tokens=train_tokens,
        response_share=1.0,  # the worst micro-batch: every token through the LM head
    )
    # In the scoring pass (old log-probs), the policy holds its states and the activations of
    # one forward batch.
    state = memory.training_state(shape, lora=lora, **state_keys)
    forward = memory.forward_activations(
        shape, forward_tokens, 1.0, whole_logits=trainer.zero_stage == 3
    )
    policy_peak = max(
        memory.policy_train_peak(shape, lora=lora, **trained),
        int(memory.FRAGMENTATION * (state[0] + forward)),
    )
    if trainer.offload_between_phases:
        policy_peak = int(RELOADED * policy_peak)
    policy_peak += CONTEXT
    # The weight sender's two packing buffers (ferrule-weightsync: 1 GiB buckets, or the largest
    # tensor), kept from sync to sync. There are none where the engines read the weights in place
    # (CUDA IPC with the policy resident).
    in_place = ray.placement == "colocate_all" and not trainer.offload_between_phases
    sync = 0 if in_place else 2 * max(GiB, shape.vocab * shape.hidden * 2)
    held = _while_generating(trainer, r, policy_peak, state) + sync
    how = (
        f"{train_tokens} tokens per micro-batch"
        + (f" (1/{shared} of each sequence)" if shared > 1 else "")
        + (", weight-sync buffers" if sync else "")
    )
    policy = Holding("policy", held, policy_peak + sync, how)
    gpus = [[policy]]
    if trainer.kl_coef > 0:
        zero = dict(zero_stage=trainer.zero_stage, ranks=trainer.reference_ranks)
        ref = CONTEXT + memory.forward_peak(shape, dtype, forward_tokens, 1.0, **zero)
        gpus.append([Holding("reference", ref, ref, f"{forward_tokens} tokens per pass")])
    if config.critic is not None:
        value_model = replace(shape, vocab=0)  # a value head instead of the LM head
        critic_trained = dict(trained, ranks=config.critic.ranks)
        peak = CONTEXT + memory.policy_train_peak(value_model, **critic_trained)
        state = memory.training_state(value_model, **dict(state_keys, ranks=config.critic.ranks))
        held = _while_generating(trainer, r, peak, state)
        gpus.append([Holding("critic", held, peak, how)])
    awake, engine_how = _engine(config, shape, gpu_bytes)
    asleep = CONTEXT if r.sleep_between_phases else awake
    gpus.append([Holding("engine", awake, asleep, engine_how)])
    if ray.placement == "colocate_all":
        return [[h for gpu in gpus for h in gpu]]
    if ray.placement == "colocate" and trainer.kl_coef > 0:  # the reference beside rank 0
        return [gpus[0] + gpus[1], *gpus[2:]]
    return gpus


def host_need(
    config: "Config", trainer: TrainerConfig, shape: ModelShape, gpus_per_node: int, processes: int
) -> HostNeed:
    """The fullest node's host memory: the offloaded states of the trained ranks on it (for each
    role, at most as many ranks as the node has GPUs), and the own bytes of its `processes`
    (`_processes_on_a_node`)."""
    dtype, lora = config.model.dtype, trainer.lora_rank > 0
    per_parameter = 0 if lora else (OFFLOADED_OPTIMIZER if trainer.offload_optimizer else 0)
    per_parameter += 0 if lora or not trainer.offload_params else memory.bytes_per(dtype)
    trained = [("policy", shape, trainer.ranks)]
    if config.critic is not None:
        trained.append(("critic", replace(shape, vocab=0), config.critic.ranks))
    total, parts = 0, []
    for role, model, ranks in trained:
        on_node = min(ranks, gpus_per_node)
        offloaded = model.parameters * per_parameter // ranks
        if trainer.offload_between_phases:  # its GPU states, parked while the engines generate
            keys = dict(zero_stage=trainer.zero_stage, ranks=ranks, lora=lora)
            offloaded += sum(memory.training_state(model, dtype=dtype, **keys))
        if offloaded:
            total += on_node * offloaded
            ranks_on_node = f"{on_node} {role} rank" + ("s" if on_node > 1 else "")
            parts.append(f"{ranks_on_node} x {offloaded / GiB:.1f} GiB offloaded")
    total += processes * PROCESS_HOST
    parts.append(f"{processes} processes x {PROCESS_HOST / GiB:.0f} GiB")
    return HostNeed(total, ", ".join(parts))


def _processes_on_a_node(config: "Config", gpus_per_node: int) -> int:
    """The number of role processes on the fullest node: the run's processes, in proportion to
    the node's share of the run's GPUs (one GPU per bundle of each placement group)."""
    from ferrule_launcher.placement import bundles, wanted_roles

    roles = wanted_roles(config)
    gpus = sum(len(group) for group in bundles(config.ray, roles).values())
    gpus += config.rollout.engines * (config.rollout.tensor_parallel_size - 1)
    return math.ceil(len(roles) * min(1.0, gpus_per_node / max(gpus, 1)))


def _while_generating(trainer: TrainerConfig, rollout, peak: int, state: tuple[int, int]) -> int:
    """A trained model's bytes while the engines generate. Usually this is its peak, which its
    allocator keeps. It is only the CUDA context where its states move out between phases, and
    its states alone where the engines sleep while it trains (the loop has the model give back
    its activations' cache before the engines wake)."""
    if trainer.offload_between_phases:
        return CONTEXT
    if rollout.sleep_between_phases:
        return CONTEXT + int(memory.FRAGMENTATION * sum(state))
    return peak


def _engine(config: "Config", shape: ModelShape, gpu_bytes: int | None) -> tuple[int, str]:
    r = config.rollout
    if r.backend == "vllm":
        share = int(r.gpu_memory_utilization * (gpu_bytes or 0))
        how = f"vLLM: gpu_memory_utilization {r.gpu_memory_utilization:g}"
        # vLLM's share must hold the engine's slice of the weights and the KV cache of one whole
        # sequence, or vLLM refuses to start. A smaller share is counted at that minimum.
        tp = r.tensor_parallel_size
        one_sequence = r.max_model_len * shape.layers * 2 * shape.kv_width * 2 // tp
        least = int(memory.FRAGMENTATION * (shape.weights(config.model.dtype) // tp + one_sequence))
        if share < least:
            how += (
                f" (too small: its weights and one sequence's KV cache need {least / GiB:.1f} "
                f"GiB a GPU at tensor_parallel_size {tp})"
            )
            share = least
        return share + CONTEXT, how
    slots = math.ceil(r.max_model_len / 64) * 64
    if r.kv_cache_tokens:  # the cache's pages, plus the one page no row holds
        tokens = math.ceil(r.kv_cache_tokens / 64) * 64 + 64
        how = f"transformers: KV cache of {tokens} tokens for {r.max_batch_size} rows"
    else:
        tokens = r.max_batch_size * slots
        how = f"transformers: KV cache of {r.max_batch_size} rows x {slots} slots"
    cache = tokens * shape.layers * 2 * shape.kv_width * 2  # bf16 keys, values
    logits = r.max_batch_size * shape.vocab * 8
    weights = shape.weights(config.model.dtype)
    total = memory.FRAGMENTATION * (weights + cache + logits + ENGINE_OVERHEAD)
    return int(total) + CONTEXT, how


# -- choosing the "auto" keys --------------------------------------------------------------------


def _options(
    trainer: TrainerConfig, hybrid: bool, groups: tuple[int, ...] = (1,)
) -> dict[str, tuple]:
    """The values each key may take: the key's own value when set, else the values the plan may
    choose from (`groups`: the sequence group sizes the ranks and the model's heads allow)."""
    auto = trainer.auto
    options = {key: (getattr(trainer, key),) for key in AUTO_KEYS}
    if "micro_batch_tokens" in auto:
        options["micro_batch_tokens"] = TOKEN_CHOICES
    if "forward_batch_tokens" in auto:  # None: micro_batch_tokens
        options["forward_batch_tokens"] = (None, *TOKEN_CHOICES)
    if "zero_stage" in auto:
        options["zero_stage"] = (2, 3)
    for key in ("gradient_checkpointing", "offload_optimizer", "offload_params"):
        if key in auto:
            options[key] = (False, True)
    if "offload_between_phases" in auto and hybrid:
        options["offload_between_phases"] = (False, True)
    if "sequence_parallel" in auto:
        options["sequence_parallel"] = groups
    return options


def _group_sizes(config: "Config", heads: int) -> tuple[int, ...]:
    """Sequence group sizes that divide the policy's ranks, the reference's (where there is
    one: resolved, so "auto" is a rank beside each policy rank or one group), the critic's and
    the model's attention heads."""
    t = config.trainer
    counts = [t.ranks, heads]
    if t.kl_coef > 0:
        counts.append(t.reference_ranks)
    if config.critic is not None:
        counts.append(config.critic.ranks)
    return tuple(n for n in range(1, t.ranks + 1) if all(c % n == 0 for c in counts))


def _rank(trainer: TrainerConfig, config: "Config", shape: ModelShape) -> tuple:
    """The sort key of the plans. First come plans whose ranks each hold whole sequences
    (sequence groups only where nothing else fits, because their all-to-alls are not in the
    estimate of seconds). Next come plans that keep everything on the GPU, however much smaller
    their micro-batches (measured at 1.5B: offloading between phases cost more than halving the
    reference's passes saved). The rest is ordered by estimated seconds."""
    offloads = trainer.offload_between_phases or trainer.offload_optimizer or trainer.offload_params
    return trainer.sequence_parallel, bool(offloads), seconds(trainer, config, shape)


def make_plan(config: "Config", machine: Machine | None = None) -> Plan | None:
    """The plan of a GPU run (None on CPU): the fastest choice of the "auto" keys that fits the
    GPUs and the nodes' host memory. When no choice fits, this returns the nearest miss, whose
    `fits()` is False. `machine` tells what [ray] gpu_memory_gb, host_memory_gb and
    gpus_per_node leave unsaid (default: this machine, queried unless [ray] gpu_memory_gb or
    address says the GPUs are elsewhere)."""
    if not config.ray.gpus_per_role:
        return None
    ray = config.ray
    # The GPUs are elsewhere when [ray] gpu_memory_gb describes them or the run joins a cluster.
    elsewhere = bool(ray.gpu_memory_gb or ray.address)
    if machine is None:
        machine = Machine(None) if elsewhere else Machine.this_one()
    gpu_bytes = int(ray.gpu_memory_gb * GiB) if ray.gpu_memory_gb else machine.gpu_memory
    host_bytes = int(ray.host_memory_gb * GiB) if ray.host_memory_gb else None
    per_node = ray.gpus_per_node
    if not elsewhere and machine.gpu_memory is not None:  # this machine runs the GPUs
        host_bytes = host_bytes or machine.host_memory
        per_node = per_node or machine.gpus_per_node
    per_node = per_node or DEFAULT_GPUS_PER_NODE
    shape = ModelShape.read(config.model.path)
    hybrid = config.ray.placement == "colocate_all" and config.loop.mode == "sync"
    options = _options(config.trainer, hybrid, _group_sizes(config, shape.heads))
    choices = (
        config.trainer.model_copy(update=dict(zip(options, values, strict=True)))
        for values in itertools.product(*options.values())
    )

    processes = _processes_on_a_node(config, per_node)  # the same for every choice

    def plan_of(trainer: TrainerConfig) -> Plan:
        gpus = holdings(config, trainer, shape, gpu_bytes)
        host = host_need(config, trainer, shape, per_node, processes)
        return Plan(trainer, gpus, gpu_bytes, host, host_bytes)

    plans = []
    valid = (trainer for trainer in choices if not trainer.offload_problems())
    for trainer in sorted(valid, key=lambda t: _rank(t, config, shape)):
        plan = plan_of(trainer)
        if plan.fits():
            return plan
        plans.append(plan)
    if not plans:  # the user's own choices contradict each other; TrainerConfig says how
        return plan_of(config.trainer)
    # the nearest miss: of the plans that fit the GPUs, the one that needs the least host
    # memory; if none fits the GPUs, the one that needs the least GPU memory
    on_gpu = [plan for plan in plans if plan.gpu_fits()]
    if on_gpu:
        return min(on_gpu, key=lambda p: p.host.bytes)
    return min(plans, key=lambda p: p.peak()[0])


def refusal(plan: Plan) -> list[tuple[str, str]]:
    """(key, message) problems of a plan that does not fit, naming what the user could change."""
    if plan.gpu_fits() and not plan.host_fits():
        message = (
            f"the memory plan does not fit the host: the plans that fit the GPUs offload to "
            f"host memory, and the least of them needs {plan.host.bytes / GiB:.1f} GiB a node "
            f"({plan.host.how}) of {HOST_HEADROOM:.0%} x {plan.host_memory / GiB:.0f} GiB (add "
            "ranks to shard the states, train LoRA adapters ([trainer] lora_rank), or set [ray] "
            "host_memory_gb if the nodes have more). `rlhf-launch CONFIG --plan` shows it."
        )
        return [("ray.host_memory_gb", message)]
    peak, phase, index = plan.peak()
    gpu = plan.gpus[index]
    parts = ", ".join(f"{h.role} {getattr(h, phase) / GiB:.1f}" for h in gpu)
    fixed = [k for k in AUTO_KEYS if k not in plan.trainer.auto]
    levers = ", ".join(f"[trainer] {k}" for k in fixed) or "nothing left to choose"
    message = (
        f"the memory plan does not fit: in the {phase} phase GPU {index} needs {peak / GiB:.1f} GiB "
        f"({parts}) of {HEADROOM:.0%} x {plan.memory / GiB:.1f} GiB, even at the plan that needs "
        f'least (set by you: {levers}; set them to "auto" to let the plan choose, lower '
        "[rollout] gpu_memory_utilization (vLLM), max_batch_size or kv_cache_tokens "
        "(transformers), turn on sleep_between_phases, or add ranks). `rlhf-launch CONFIG "
        "--plan` shows every process."
    )
    key = f"trainer.{fixed[0]}" if fixed else "trainer.micro_batch_tokens"
    return [(key, message)]
