"""The run's configuration: one TOML file, one table per component, checked before anything starts.

    config = load_config("examples/tiny.toml")      # raises ConfigError naming file, table, key
    print(config.rollout.samples_per_prompt)

Every field has a docstring (shown by `rlhf-launch --dry-run`'s neighbour, `describe()`). Unknown
keys, wrong types, out-of-range values, missing files and contradictory settings are errors of
the form `tiny.toml: [rollout] temperature: must be > 0, got -1`. Paths read by the run (model,
reward function files) are relative to the TOML file; the output directory is relative to the
current directory.
"""

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gae",
)
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")


class ConfigError(ValueError):
    """The configuration is wrong; the message names the file, the table and the key."""


class Table(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class ModelConfig(Table):
    path: Path
    """Hugging Face model directory (config, weights, tokenizer), relative to the TOML file."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Training dtype; use fp32 on CPUs without bf16 instructions."""


class TaskConfig(Table):
    name: Literal["reversal", "arithmetic", "jsonl"] = "reversal"
    """"reversal" (reverse a short word), "arithmetic" (add two numbers), or "jsonl": your
    prompts and labels from train_file / eval_file."""
    train_file: Path | None = None
    """jsonl: training prompts, one JSON object per line (relative to the TOML file)."""
    eval_file: Path | None = None
    """jsonl: held-out prompts for greedy accuracy (the first eval_prompts lines)."""
    prompt_key: str = "prompt"
    """jsonl: the key of the prompt in each line."""
    label_key: str = "label"
    """jsonl: the key of the label (the reward function's `label`; may be absent)."""
    length: int = Field(3, ge=1, le=12)
    """Letters per word (reversal) or largest number of digits of the first operand (arithmetic)."""
    eval_prompts: int = Field(100, ge=1, le=10_000)
    """Held-out prompts for greedy accuracy; never used for training."""
    seed: int = 0
    """Seed of the prompt streams (training and held-out)."""


class SFTConfig(Table):
    steps: int = Field(60, ge=0)
    """Supervised warm-start steps on the task's answers before RL (0: none)."""
    batch_size: int = Field(32, ge=1)
    """Examples per SFT step."""
    learning_rate: float = Field(1e-3, gt=0)
    """SFT peak learning rate (AdamW)."""


class RolloutConfig(Table):
    engines: int = Field(1, ge=1, le=64)
    """vLLM engines; each prompt batch is split between them."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per RL step."""
    samples_per_prompt: int = Field(8, ge=1)
    """Samples generated per prompt (the group size of the group estimators)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0; the trainer scores tokens under the same temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_tokens: int = Field(8, ge=1)
    """Most new tokens per sample."""
    max_model_len: int = Field(128, ge=8)
    """Longest prompt + response the engine accepts."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Fraction of device memory for vLLM (of CPU memory on CPU; VLLM_CPU_KVCACHE_SPACE wins)."""
    transport: Literal["auto", "broadcast", "ipc"] = "auto"
    """Weight sync: "broadcast" (NCCL / gloo), "ipc" (CUDA IPC / shared memory, colocated
    processes on one host only), "auto" (ipc when everything is colocated, else broadcast)."""


class RewardsConfig(Table):
    function: str = ""
    """Reward function `module:function` or `file.py:function` served by ferrule-rewards."""
    model: Path | None = None
    """Hugging Face reward-model folder served by ferrule-rewards (relative to the TOML file)."""
    address: list[str] = []
    """host:port of running ferrule-rewards servers to use instead of starting one."""
    timeout: float = Field(60.0, gt=0)
    """Deadline per scoring call, seconds."""
    retry_for: float = Field(20.0, ge=0)
    """Seconds a call keeps being retried while no server takes it; then the run stops with an
    error naming the addresses."""
    start_timeout: float = Field(60.0, gt=0)
    """Seconds the started server may take to accept calls."""


class TrainerConfig(Table):
    estimator: Literal[ESTIMATORS] = "grpo"  # type: ignore[valid-type]
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline,
    or gae (PPO with a critic; needs [critic])."""
    learning_rate: float = Field(1e-4, gt=0)
    """Actor learning rate (AdamW)."""
    ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel ranks of the policy (DeepSpeed), one Ray actor and one bundle each."""
    epochs: int = Field(1, ge=1)
    """PPO epochs: optimizer passes over each rollout batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch (the rollout batch is split into this many)."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward."""
    clip_low: float = Field(0.2, ge=0)
    """PPO ratio clip below 1."""
    clip_high: float = Field(0.28, ge=0)
    """PPO ratio clip above 1 (DAPO's clip-higher)."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (None: off)."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses are reduced."""
    kl_coef: float = Field(0.0, ge=0)
    """KL(policy || reference) coefficient; > 0 starts the reference model."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (k1 belongs in the reward, k2 / k3 in the loss)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL goes: a loss term (GRPO) or a per-token reward penalty (PPO, REINFORCE++)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount of the per-token returns (gae, reinforce_plus_plus*)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""


class CriticConfig(Table):
    learning_rate: float = Field(1e-4, gt=0)
    """Critic learning rate (AdamW)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the value update around the old values (None: off)."""


class LoopConfig(Table):
    steps: int = Field(40, ge=1)
    """RL steps (one rollout batch, its training and a weight sync each)."""
    mode: Literal["sync", "async"] = "sync"
    """"sync": generate, then train, then sync. "async": generation of step k+1 overlaps
    training of step k."""
    max_staleness: int = Field(1, ge=0)
    """Async: the most policy versions a sample may lag the trainer; older samples are dropped."""
    queue_size: int = Field(1, ge=1)
    """Async: rollout batches generated ahead and waiting for the trainer."""
    eval_every: int = Field(10, ge=0)
    """Greedy held-out accuracy every this many steps (0: only at the start and the end)."""
    seed: int = 0
    """Seed of the training prompt order and of the models' initialisation."""


class RayConfig(Table):
    address: str = ""
    """Ray cluster to join ("auto" or "host:port"); empty starts a local cluster."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local cluster (default: all)."""
    placement: Literal["colocate_all", "colocate", "separate"] = "colocate_all"
    """"colocate_all": every role in one bundle (one device). "colocate": actor + reference in
    one placement group, critic in another, rollout engines in a third. "separate": every role
    in its own placement group."""
    cpus_per_role: float = Field(0.5, gt=0)
    """CPUs each role asks Ray for (fractions let roles share a small machine)."""
    gpus_per_role: float = Field(0.0, ge=0)
    """GPUs each role asks for (0 on CPU machines; fractions share a GPU when colocated)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy for the groups that hold several bundles."""
    roles_on_nodes: dict[str, str] = {}
    """Pin a role ("policy", "rollout", "critic") to a node by a custom resource name the node
    was started with (e.g. {rollout = "node:worker"} needs `--resources '{"worker": 1}'`)."""


class OutputConfig(Table):
    dir: Path = Path("runs/latest")
    """Where metrics, checkpoints, the final policy and summary.json go (relative to the
    current directory)."""
    checkpoint_every: int = Field(10, ge=0)
    """Save resumable state every this many steps (0: never; --resume then starts over)."""
    tensorboard: bool = True
    """Also write TensorBoard event files under dir/tensorboard."""
    progress: bool = True
    """Show a progress bar (a log line per step when off or when not on a terminal)."""


class Config(Table):
    model: ModelConfig
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig(steps=0)
    rollout: RolloutConfig = RolloutConfig()
    rewards: RewardsConfig = RewardsConfig()
    trainer: TrainerConfig = TrainerConfig()
    critic: CriticConfig | None = None
    loop: LoopConfig = LoopConfig()
    ray: RayConfig = RayConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _consistent(self):
        """Settings that are each valid but contradict one another: (table, key, message)."""
        t, r, w = self.trainer, self.rollout, self.rewards
        problems = []
        given = [
            name
            for name, v in (("function", w.function), ("model", w.model), ("address", w.address))
            if v
        ]
        if len(given) != 1:
            problems.append(
                (
                    "rewards",
                    "function",
                    f"give exactly one of function, model or address, got {given or 'none'}",
                )
            )
        if t.estimator in GROUP_ESTIMATORS and r.samples_per_prompt < 2:
            problems.append(
                (
                    "rollout",
                    "samples_per_prompt",
                    f"must be >= 2 for estimator "
                    f"{t.estimator!r} (it compares samples of a prompt), got 1",
                )
            )
        if t.estimator == "gae" and self.critic is None:
            problems.append(("trainer", "estimator", '"gae" needs a [critic] table'))
        if t.estimator != "gae" and self.critic is not None:
            problems.append(
                (
                    "critic",
                    "learning_rate",
                    f"a [critic] is only used by estimator "
                    f'"gae", not {t.estimator!r}: remove the table',
                )
            )
        if t.kl_in == "reward" and t.estimator in ("grpo", "dr_grpo", "rloo"):
            problems.append(
                (
                    "trainer",
                    "kl_in",
                    f'"reward" is not supported by estimator {t.estimator!r}; use "loss"',
                )
            )
        if t.kl_in == "loss" and t.kl_coef > 0 and t.kl_kind == "k1":
            problems.append(
                (
                    "trainer",
                    "kl_kind",
                    '"k1" has zero gradient in expectation as a '
                    'loss term; use "k2" or "k3", or kl_in = "reward"',
                )
            )
        task = self.task
        if task.name == "jsonl" and (task.train_file is None or task.eval_file is None):
            problems.append(("task", "train_file", '"jsonl" needs train_file and eval_file'))
        if task.name != "jsonl" and (task.train_file or task.eval_file):
            problems.append(
                (
                    "task",
                    "train_file" if task.train_file else "eval_file",
                    f'only read by name = "jsonl", not {task.name!r}',
                )
            )
        if task.name == "jsonl" and self.sft.steps:
            problems.append(
                (
                    "sft",
                    "steps",
                    "the SFT warm start needs a synthetic task (its "
                    'answers); with name = "jsonl" start from a warm-started model',
                )
            )
        if r.max_tokens >= r.max_model_len:
            problems.append(
                (
                    "rollout",
                    "max_tokens",
                    f"must be < max_model_len {r.max_model_len}, got {r.max_tokens}",
                )
            )
        batch = r.prompts_per_step * r.samples_per_prompt
        if batch % (t.mini_batches * t.ranks):
            problems.append(
                (
                    "trainer",
                    "mini_batches" if batch % t.mini_batches else "ranks",
                    f"mini_batches x ranks must divide the rollout batch "
                    f"(prompts_per_step x samples_per_prompt = {batch}), got "
                    f"{t.mini_batches} x {t.ranks}",
                )
            )
        if r.prompts_per_step % r.engines:
            problems.append(
                (
                    "rollout",
                    "engines",
                    f"must divide prompts_per_step {r.prompts_per_step}, got {r.engines}",
                )
            )
        if r.transport == "ipc" and self.ray.placement != "colocate_all":
            problems.append(
                (
                    "rollout",
                    "transport",
                    '"ipc" needs placement = "colocate_all" (one host); use "broadcast" or "auto"',
                )
            )
        if self.loop.mode == "sync" and self.loop.max_staleness != LoopConfig().max_staleness:
            problems.append(("loop", "max_staleness", 'only applies to mode = "async"'))
        if self.ray.roles_on_nodes and self.ray.placement == "colocate_all":
            problems.append(
                (
                    "ray",
                    "roles_on_nodes",
                    "cannot pin roles to nodes with "
                    'placement = "colocate_all" (one bundle); use "separate"',
                )
            )
        for role in self.ray.roles_on_nodes:
            if role not in ("policy", "rollout", "critic"):
                problems.append(
                    (
                        "ray",
                        "roles_on_nodes",
                        f"unknown role {role!r}; roles are policy, rollout, critic",
                    )
                )
        if problems:
            raise _Contradiction(problems)
        return self


class _Contradiction(ValueError):
    def __init__(self, problems):
        super().__init__("; ".join(m for _, _, m in problems))
        self.problems = problems


def load_config(path: str | Path, overrides: dict | None = None) -> Config:
    """Read, validate and resolve `path`; every problem raises one ConfigError listing all."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    for key, value in (overrides or {}).items():  # "loop.steps" = 3
        table, _, name = key.partition(".")
        data.setdefault(table, {})[name] = value
    try:
        config = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(path, err)) from None
    config = _resolve(config, path.parent)
    missing = _missing_files(config)
    if missing:
        raise ConfigError("\n".join(f"{path}: [{t}] {k}: {m}" for t, k, m in missing))
    return config


def _format(path: Path, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        ctx = e.get("ctx") or {}
        if isinstance(ctx.get("error"), _Contradiction):
            lines += [f"{path}: [{t}] {k}: {m}" for t, k, m in ctx["error"].problems]
            continue
        loc = [str(part) for part in e["loc"]]
        table, key = (loc[0], ".".join(loc[1:])) if len(loc) > 1 else ("", loc[0] if loc else "")
        where = f"[{table}] {key}" if table else f"table [{key}]"
        if e["type"] == "extra_forbidden":
            message = "unknown key" if table else "unknown table"
            known = _known(table)
            if known:
                message += f" (known: {', '.join(known)})"
        elif e["type"] == "missing":
            message = "is required"
        else:
            message = f"{e['msg']}, got {e['input']!r}"
        lines.append(f"{path}: {where}: {message}")
    return "\n".join(lines)


def _known(table: str) -> list[str]:
    model = Config if not table else Config.model_fields.get(table)
    if model is not Config:
        annotation = model.annotation if model else None
        model = next(
            (
                a
                for a in getattr(annotation, "__args__", (annotation,))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
    return sorted(model.model_fields) if model else []


def _resolve(config: Config, base: Path) -> Config:
    """Input paths relative to the TOML file become absolute."""

    def near(p: Path) -> Path:
        return p if p.is_absolute() else (base / p).resolve()

    updates = {"model": config.model.model_copy(update={"path": near(config.model.path)})}
    rewards = config.rewards
    if rewards.model is not None:
        rewards = rewards.model_copy(update={"model": near(rewards.model)})
    module, _, fn = rewards.function.rpartition(":")
    if module.endswith(".py"):
        rewards = rewards.model_copy(update={"function": f"{near(Path(module))}:{fn}"})
    updates["rewards"] = rewards
    task = config.task
    updates["task"] = task.model_copy(
        update={
            key: near(getattr(task, key))
            for key in ("train_file", "eval_file")
            if getattr(task, key) is not None
        }
    )
    return config.model_copy(update=updates)


def _missing_files(config: Config) -> list[tuple[str, str, str]]:
    missing = []
    if not (config.model.path / "config.json").is_file():
        missing.append(
            ("model", "path", f"no Hugging Face model at {config.model.path} (config.json missing)")
        )
    for key in ("train_file", "eval_file"):
        path = getattr(config.task, key)
        if path is not None and not path.is_file():
            missing.append(("task", key, f"no file {path}"))
    if config.rewards.model is not None and not config.rewards.model.is_dir():
        missing.append(("rewards", "model", f"no reward model folder {config.rewards.model}"))
    module = config.rewards.function.rpartition(":")[0]
    if module.endswith(".py") and not Path(module).is_file():
        missing.append(("rewards", "function", f"no file {module}"))
    elif module and not module.endswith(".py") and not _importable(module):
        missing.append(("rewards", "function", f"no module {module!r} to import"))
    return missing


def _importable(module: str) -> bool:
    """Whether `module` can be found without importing it (its parents are imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def describe(config: Config) -> str:
    """The resolved configuration as TOML-like text, for --dry-run."""
    lines = []
    for table, value in config.model_dump(mode="json").items():
        if value is None:
            continue
        lines.append(f"[{table}]")
        for key, item in value.items():
            lines.append(f"{key} = {_toml(item)}")
        lines.append("")
    return "\n".join(lines)


def _toml(value) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)
