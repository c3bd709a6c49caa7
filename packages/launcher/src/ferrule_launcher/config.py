"""The run's configuration: one TOML file, one table per component (load.py reads it).

Each component defines its own tables: [model] [trainer] [critic] come from ferrule-trainer, and
the engine and sampling keys of [rollout] from ferrule-rollout. This file adds the run's own
tables ([task] [sft] [rewards] [loop] [environment] [eval] [ray] [output]). Each table checks its
own keys; the rules that span tables are in checks.py, which load.load_config runs. Paths the
run reads (model, reward function files, JSONL tasks) are relative to the TOML file; the output
directory is relative to the current directory.
"""

import importlib.util
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from ferrule_config import ConfigError, InputPath, Problems, Table, describe
from ferrule_rollout.config import EngineConfig
from ferrule_trainer import (
    CriticConfig,
    IterativeDPOConfig,
    ModelConfig,
    RejectionSamplingConfig,
    TrainerConfig,
)

__all__ = ["Config", "ConfigError", "describe"]


class SourceConfig(Table):
    """One [[task.sources]] entry: a dataset of prompts (data.py)."""

    path: InputPath
    """Training prompts: a .jsonl file (one JSON object per line), a .parquet file, or a
    `datasets.save_to_disk` folder (relative to the TOML file)."""
    eval_path: InputPath | None = None
    """Held-out prompts of this source for the evaluations, in any format that `path` accepts.
    The first [task] eval_prompts rows are used. At least one source needs it."""
    name: str = ""
    """The name that this source's metrics go under (eval/<name>/..., reward/<name>). Empty
    means the file's stem. A row's own `source_key` column, where present, takes precedence."""
    weight: float = Field(1.0, gt=0)
    """Mixing weight: a training prompt comes from this source with probability weight / the
    sum of the weights."""
    prompt_key: str = "prompt"
    """The column of the prompt: a string, or chat messages ([{"role": ..., "content": ...}])
    rendered with the model's chat template."""
    label_key: str = "label"
    """The column of the label, passed as the reward function's `label` (may be absent; a
    value that is not a string is sent as JSON)."""
    metadata_key: str | None = None
    """A column of JSON objects passed to the reward function as `metadata` (values as
    strings), beside the run's own `source`, `step` and `sample_id`, which take precedence."""
    source_key: str = "source"
    """The column that names a row's own source for the per-source metrics. A row without
    it belongs to `name`."""
    split: str = "train"
    """The split of path when it is a DatasetDict folder."""
    eval_split: str = "test"
    """The split of eval_path when it is a DatasetDict folder."""

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data):
        if isinstance(data, dict) and not data.get("name") and data.get("path"):
            return {**data, "name": Path(data["path"]).stem}
        return data


class TaskConfig(Table):
    """[task]: where the prompts come from: a built-in synthetic task or your datasets."""

    name: Literal["reversal", "arithmetic", "data"] = "reversal"
    """"reversal" (reverse a short word), "arithmetic" (add two numbers), or "data": your
    prompts and labels from [[task.sources]]."""
    sources: list[SourceConfig] = Field(default_factory=list)
    """data: the datasets, one [[task.sources]] table each. They are mixed by weight and
    read in epochs."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """data: prompts longer than this many tokens are dropped when loaded, and counted. None
    means [rollout] max_model_len - max_tokens, which leaves room for a full response."""
    length: int = Field(3, ge=1, le=12)
    """Letters per word (reversal) or largest number of digits of the first operand (arithmetic)."""
    eval_prompts: int = Field(100, ge=1, le=10_000)
    """Held-out prompts for the evaluations ([eval]), per source; never used for training."""
    seed: int = 0
    """Seed of the prompt streams (training order and held-out)."""

    renamed: ClassVar[dict[str, str]] = {  # the form before 2026-11-25 (CHANGELOG 0.1.0)
        "train_file": 'was renamed: use name = "data" and a [[task.sources]] table with '
        "path = {value}",
        "eval_file": "was renamed: use eval_path = {value} in a [[task.sources]] table",
        "prompt_key": "moved: write prompt_key = {value} in each [[task.sources]] table",
        "label_key": "moved: write label_key = {value} in each [[task.sources]] table",
    }

    @field_validator("name", mode="before")
    @classmethod
    def _renamed_name(cls, name):
        if name == "jsonl":
            raise ValueError(
                '"jsonl" was renamed: use name = "data" and one [[task.sources]] table per file '
                "(path = the train_file, eval_path = the eval_file)"
            )
        return name


class WarmStartConfig(Table):
    """[sft]: an optional supervised warm start of the policy before RL."""

    steps: int = Field(60, ge=0)
    """Supervised warm-start steps before RL (0: none), trained on `data`, or else on the
    synthetic task's answers."""
    data: InputPath | None = None
    """A JSONL file of examples for the warm start, as `rlhf-train sft` reads (a prompt and a
    response per line); needed with [task] name = "data"."""
    prompt_key: str = "prompt"
    """data: the key of the prompt in each line."""
    response_key: str = "response"
    """data: the key of the response in each line."""
    batch_size: int = Field(32, ge=1)
    """Examples per SFT step."""
    learning_rate: float = Field(1e-3, gt=0)
    """SFT peak learning rate (AdamW)."""


class RolloutConfig(EngineConfig):
    """[rollout]: generation (ferrule-rollout's engine and sampling keys) and the engines' roles."""

    engines: int = Field(1, ge=1, le=64)
    """Rollout engines (vLLM or transformers); each prompt batch is split between them."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per RL step."""
    samples_per_prompt: int = Field(8, ge=1)
    """Samples generated per prompt (the group size of the group estimators)."""
    transport: Literal["auto", "broadcast", "ipc", "host"] = "auto"
    """Weight sync: "broadcast" (NCCL on GPUs, gloo on CPU), "ipc" (CUDA IPC on GPUs, shared
    memory on CPU; colocated processes on one host only), "auto" (ipc when everything is
    colocated, else broadcast), or "host" (shared memory even on GPUs: every byte through host
    memory; slower, the baseline of benchmarks/e2e_gpu.py)."""
    max_restarts: int = Field(3, ge=0)
    """An engine whose actor dies is replaced by a new one, which gets the policy's current
    weights and the dead engine's prompts. This happens at most this many times within
    restart_window seconds over all engines; one more death stops the run (0: the first death
    does)."""
    restart_window: float = Field(600.0, gt=0)
    """Seconds over which max_restarts counts."""


class RewardsConfig(Table):
    """[rewards]: how samples are scored: one of function, model or address."""

    function: str = ""
    """Reward function `module:function` or `file.py:function` served by ferrule-rewards."""
    model: InputPath | None = None
    """Hugging Face reward-model folder served by ferrule-rewards (relative to the TOML file),
    in a Ray role of its own (resources: gpus, cpus; [ray] roles_on_nodes can pin "rewards")."""
    gpus: float | None = Field(None, ge=0)
    """model: GPUs of the reward model's role (default [ray] gpus_per_role; 0: on CPU)."""
    cpus: float | None = Field(None, gt=0)
    """model: CPUs of the reward model's role (default [ray] cpus_per_role)."""
    normalize: bool = False
    """model: return (score - mean) / std instead of the score. The mean and std are those
    of held-out scores, saved beside the model (reward_stats.json, written by `rlhf-train rm`)."""
    model_batch_tokens: int = Field(32768, ge=1)
    """model: tokens per forward pass of the reward model, counted as samples x the longest
    sample's tokens (at most 32 samples). A sample longer than this goes alone."""
    address: list[str] = Field(default_factory=list)
    """host:port of running ferrule-rewards servers to use instead of starting one."""
    timeout: float = Field(60.0, gt=0)
    """Deadline per scoring call, seconds."""
    retry_for: float = Field(20.0, ge=0)
    """Seconds a call keeps being retried while no server takes it. After that, the run stops
    with an error naming the addresses."""
    start_timeout: float = Field(60.0, gt=0)
    """Seconds the started server may take to accept calls."""
    max_failed_fraction: float = Field(0.1, ge=0, le=1)
    """A sample whose reward function raised, timed out or returned no number scores 0.0 and is
    counted (metric reward/failed). A step where more than this fraction of the samples failed
    stops the run with an error naming the function. 1.0 means never stop."""
    max_restarts: int = Field(3, ge=0)
    """When a reward server that this run started dies, it is started again, at most this many
    times within restart_window seconds. One more death stops the run (0: the first death
    does)."""
    restart_window: float = Field(600.0, gt=0)
    """Seconds over which max_restarts counts."""

    renamed: ClassVar[dict[str, str]] = {  # the form before 2026-11-21 (CHANGELOG 0.1.0)
        "attempts": "was replaced by retry_for: the seconds a call keeps being retried while "
        "no server takes it (default 20)",
    }

    @field_validator("function")
    @classmethod
    def _near_the_file(cls, function: str, info: ValidationInfo) -> str:
        return _near_the_toml(function, info)

    def missing(self) -> list[tuple[str, str]]:
        """What the table names that is not there: (key, message)."""
        module = self.function.rpartition(":")[0]
        if module.endswith(".py") and not Path(module).is_file():
            return [("function", f"no file {module}")]
        if module and not module.endswith(".py") and not _importable(module):
            return [("function", f"no module {module!r} to import")]
        if self.model is not None and not self.model.is_dir():
            return [("model", f"no reward model folder {self.model}")]
        return []


def _importable(module: str) -> bool:
    """Whether `module` can be found without importing it (its parents are imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class LoopConfig(Table):
    """[loop]: the RL loop: steps, what a step trains on, sync or async, evaluations."""

    renamed: ClassVar[dict[str, str]] = {  # the form before 2026-11-30 (CHANGELOG 0.1.0)
        "dpo_beta": "moved: write beta = {value} in [iterative_dpo]",
        "dpo_nll_coef": "moved: write nll_coef = {value} in [iterative_dpo]",
        "chosen_min_reward": "moved: write chosen_min_reward = {value} in the table of your "
        "[loop] algorithm: [rejection_sampling] or [iterative_dpo]",
    }

    steps: int = Field(40, ge=1)
    """RL steps (each is one rollout batch, training on it, and a weight sync)."""
    algorithm: Literal["rl", "rejection_sampling", "iterative_dpo"] = "rl"
    """What a step trains on its samples: "rl" (the RL step of [trainer] estimator),
    "rejection_sampling" (SFT on each prompt's best sample by reward, best-of-n), or
    "iterative_dpo" (DPO on each prompt's best and worst sample as a pair, against the
    starting model as the reference). Each recipe has its settings in a table of its own:
    [rejection_sampling], [iterative_dpo]."""
    mode: Literal["sync", "async"] = "sync"
    """"sync": generate, then train, then sync. "async": generation of step k+1 overlaps
    training of step k."""
    max_staleness: int = Field(1, ge=0)
    """Async, or sync with partial_rollout: the most policy versions that a sample may lag
    behind the trainer. Older samples are dropped. In sync mode with partial_rollout, a sample is
    also continued at most this many times; the last continuation runs to its end."""
    queue_size: int = Field(1, ge=1)
    """Async: rollout batches generated ahead and waiting for the trainer."""
    eval_every: int = Field(10, ge=0)
    """Run the held-out evaluation ([eval]) every this many steps (0: only at the start and the
    end)."""
    seed: int = 0
    """Seed of the training prompt order and of the models' initialisation."""
    partial_rollout: bool = False
    """Samples continue across weight syncs. Each sample records the version of every stretch of its
    tokens. The sample's version is the oldest of these, and the metric
    rollout/mixed_version_samples counts samples with more than one. Async (backend "vllm"): a
    weight sync freezes the engines' running samples, which continue on the new weights (pause mode
    "keep") instead of finishing on the old ones first. Sync (backend "transformers"): a step's
    generation ends once no prompt waits and fewer than partial_cut of the engine's rows still
    decode. Those samples continue in the next step's generation under the new weights, and a prompt
    group is scored and trained once all its samples end (complete groups beyond prompts_per_step
    wait for the next step). A long-tailed batch then does not decode its last rows almost alone: at
    1.5B and a 4096-token cap, a step took 23.9 s with max_staleness = 2 against 30.4 s without
    partial rollouts. max_staleness = 1 is no faster, as each continued sample must then end in its
    second call (benchmarks/RESULTS.md). A checkpoint keeps the groups in flight and the complete
    groups waiting, and a resumed run continues them."""
    partial_cut: float = Field(0.125, gt=0, le=1)
    """Sync with partial_rollout: a step's generation is cut once fewer than this fraction of
    [rollout] max_batch_size rows still decode (at least one row)."""
    keep_group_mean: tuple[float, float] | None = None
    """DAPO's dynamic sampling: [low, high]. Prompt groups whose mean score is not strictly
    between low and high are dropped, and new prompts are drawn until the batch is full. With
    0/1 rewards, [0, 1] drops the all-wrong and all-right groups. None keeps every group."""
    max_draws: int = Field(4, ge=1)
    """With keep_group_mean: the most generate-and-score rounds per step. A batch that is still
    short after them is trained as it is (metrics filter/draws, filter/kept_groups)."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.keep_group_mean is not None and not (
            self.keep_group_mean[0] < self.keep_group_mean[1]
        ):
            raise Problems(
                [("keep_group_mean", f"needs low < high, got {list(self.keep_group_mean)}")]
            )
        return self


class EnvironmentConfig(Table):
    """[environment]: multi-turn episodes instead of one generation per sample (ferrule-rollout's
    episodes.py). Each of a step's prompts x samples_per_prompt samples is an episode: the
    environment's first observation, then model turns and the environment's answers until the
    environment says done or the budget runs out. The episode trains as one sample whose
    response is the whole transcript, with the environment's tokens masked out of every loss."""

    name: str
    """The environment class, `module:Class` or `file.py:Class` (relative to the TOML file), a
    subclass of ferrule_rollout.environments.Environment (ToolEnvironment for tool calls)."""
    options: dict = Field(default_factory=dict)
    """Keyword arguments of the class; each episode gets its own instance."""
    max_turns: int = Field(4, ge=1)
    """The most model turns per episode."""
    max_tokens: int = Field(256, ge=1)
    """The most tokens per episode after the first observation (the model's and the
    environment's); each turn also stops at [rollout] max_tokens."""
    step_timeout: float = Field(60.0, gt=0)
    """Seconds each reset / step call may take. A slower call fails its episode (env_timeout)."""
    reward: Literal["environment", "reward_server", "sum"] = "environment"
    """An episode's score: the sum of the environment's rewards, the reward server's score of
    the transcript ([rewards] as for single-turn runs), or both added."""
    max_failed_fraction: float = Field(0.1, ge=0, le=1)
    """A failed episode (the environment or a tool raised, hung or answered garbage) is not
    trained on: its prompt group is dropped and counted (episodes/failed_<reason>). A step
    where more than this fraction failed stops the run with an error naming the environment."""

    @field_validator("name")
    @classmethod
    def _near_the_file(cls, name: str, info: ValidationInfo) -> str:
        return _near_the_toml(name, info)

    def missing(self) -> list[tuple[str, str]]:
        """The class must load (before any process starts): (key, message)."""
        from ferrule_rollout.environments import EnvironmentLoadError, load_environment

        try:
            load_environment(self.name)
        except EnvironmentLoadError as err:
            return [("name", str(err))]
        return []


def _near_the_toml(spec: str, info: ValidationInfo) -> str:
    """`file.py:name` becomes absolute, taken from the TOML file's folder."""
    module, _, name = spec.rpartition(":")
    base = (info.context or {}).get("base")
    if module.endswith(".py") and base is not None and not Path(module).is_absolute():
        return f"{(base / module).resolve()}:{name}"
    return spec


ROLE_KINDS = ("policy", "rollout", "critic", "rewards")
"""The kinds of role that `roles_on_nodes` can pin (the reference goes with the policy)."""


class RayConfig(Table):
    """[ray]: the cluster and how the roles are placed on it."""

    address: str = ""
    """Ray cluster to join ("auto" or "host:port"). Empty starts a local cluster for this run
    alone, even where RAY_ADDRESS is set or `ray start` ran on this machine."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local cluster (default: all)."""
    placement: Literal["colocate_all", "colocate", "separate"] = "colocate_all"
    """"colocate_all": one placement group; policy rank i, engine i and reference / critic rank
    i share bundle i (one device). "colocate": policy + reference in one placement group,
    critic in another, rollout engines in a third. "separate": every role in its own placement
    group."""
    threads_per_role: int | None = Field(None, ge=1)
    """CPU machines: torch's threads in each role's process (OMP_NUM_THREADS). Default: the
    local cluster's CPUs shared among the roles that compute at the same moment (1 when joining
    a cluster). GPU machines with [trainer] offload_optimizer: DeepSpeed CPU Adam's threads in
    each policy and critic rank. Default: the node's cores shared among those ranks (Ray alone
    would give each rank as many threads as the CPUs it asked for)."""
    cpus_per_role: float = Field(0.5, gt=0)
    """CPUs each role asks Ray for (fractions let roles share a small machine)."""
    gpus_per_role: float = Field(0.0, ge=0)
    """GPUs each role asks for (0 on CPU machines; fractions share a GPU when colocated)."""
    gpu_memory_gb: float | None = Field(None, gt=0)
    """GiB of memory of each GPU, for the memory plan. None means nvidia-smi's figure on the
    machine that launches; set it where that machine has no GPU, e.g. a Ray head node."""
    host_memory_gb: float | None = Field(None, gt=0)
    """GiB of host memory of each GPU node, for the offloaded states of the memory plan. None
    means this machine's memory when this machine runs the GPUs itself. When gpu_memory_gb or
    address say the GPUs are elsewhere, None leaves it unknown and not checked."""
    gpus_per_node: int | None = Field(None, ge=1)
    """GPUs of each node, for the host memory that the ranks on a node share. None means this
    machine's count when this machine runs the GPUs itself, else 8."""
    check_memory: bool = True
    """GPU runs: refuse a plan whose estimated peak does not fit the GPUs (`--plan` prints the
    plan). false starts anyway (the estimate assumes every token is a response token)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy for the groups that hold several bundles."""
    roles_on_nodes: dict[str, str] = Field(default_factory=dict)
    """Pin a role ("policy", "rollout", "critic", or "rewards" for a [rewards] model) to a node,
    by a custom resource name that the node was started with (e.g. {rollout = "node:worker"}
    needs `--resources '{"worker": 1}'`)."""

    @model_validator(mode="after")
    def _pinnable(self):
        problems = []
        if self.roles_on_nodes and self.placement == "colocate_all":
            problems.append(
                (
                    "roles_on_nodes",
                    'cannot pin roles to nodes with placement = "colocate_all" (one bundle); '
                    'use "separate"',
                )
            )
        for kind in self.roles_on_nodes:
            if kind not in ROLE_KINDS:
                problems.append(
                    ("roles_on_nodes", f"unknown role {kind!r}; roles are {', '.join(ROLE_KINDS)}")
                )
        if problems:
            raise Problems(problems)
        return self


class EvalConfig(Table):
    """[eval]: the held-out evaluations (when: [loop] eval_every)."""

    samples: int = Field(4, ge=1, le=256)
    """Samples per held-out prompt at each evaluation ([loop] eval_every, the start and the
    end), scored by the run's reward function."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of the evaluation's samples."""
    pass_k: int = Field(4, ge=1)
    """Report pass@1 and pass@pass_k (unbiased estimator over the samples); <= samples."""
    threshold: float = 1.0
    """A sample counts as a success for pass@k when its reward reaches this."""

    @model_validator(mode="after")
    def _k_fits(self):
        if self.pass_k > self.samples:
            raise Problems([("pass_k", f"must be <= samples = {self.samples}, got {self.pass_k}")])
        return self


class OutputConfig(Table):
    """[output]: metrics, checkpoints and the final policy."""

    dir: Path = Path("runs/latest")
    """Where metrics, checkpoints, the final policy and summary.json go (relative to the
    current directory)."""
    checkpoint_every: int = Field(10, ge=0)
    """Save resumable state every this many steps (0: never; --resume then starts over). A
    checkpoint holds the policy's (and critic's) weights, fp32 master weights and Adam moments.
    At 1.5B it is 18 GB, written in 26-32 s on an H200 machine's local disk (the bf16 weights
    3.5-4.3 s, the optimizer 22-28 s), the time of some 4 steps of 256-token GRPO, and loaded in
    ~15 s on --resume (benchmarks/RESULTS.md). The metric time/checkpoint records each save's
    seconds. The writes of each role's weights and optimizer are time/checkpoint/policy_weights
    and .../policy_optimizer (likewise for the critic)."""
    keep_last: int = Field(3, ge=1)
    """How many of the newest complete checkpoints to keep. An older one is deleted once a
    newer one is complete. The checkpoint that keep_best picks is kept too."""
    keep_best: str | None = None
    """Also keep the checkpoint with the best value of this metric (a metrics.jsonl key, such
    as "eval/pass@1" or "reward"). An "eval/" metric needs checkpoint_every to be a multiple of
    [loop] eval_every, so that every checkpoint has a value."""
    keep_best_mode: Literal["max", "min"] = "max"
    """Whether the best value of keep_best is the largest or the smallest."""
    export_every: int = Field(0, ge=0)
    """Write the policy in Hugging Face format to dir/exports/stepN every this many steps (0: only
    the final one, dir/policy). At 1.5B an export is 3 GB of bf16 safetensors and takes 1-8 s on an
    H200 machine (median 2.6 s). The metric time/export records each export's seconds."""
    tensorboard: bool = True
    """Also write TensorBoard event files under dir/tensorboard."""
    wandb: bool = False
    """Also log to Weights & Biases (the `wandb` extra: pip install 'ferrule-launcher[wandb]'), with
    files under dir/wandb. Each launch is a W&B run of its own, grouped by the name of dir."""
    wandb_project: str = "ferrule"
    """The W&B project."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """"offline" needs no account or network (`wandb sync dir/wandb/offline-run-*` uploads
    later). "online" logs as the run goes (WANDB_API_KEY or `wandb login`)."""
    sample_rows: int = Field(8, ge=0)
    """How many held-out prompts have their first sample (prompt, response, reward) logged at
    each evaluation: to dir/eval_samples.jsonl, to TensorBoard text "eval/samples", and to a W&B
    table."""
    progress: bool = True
    """Show a progress bar (a log line per step when off or when not on a terminal)."""


class Config(Table):
    model: ModelConfig
    task: TaskConfig = TaskConfig()
    sft: WarmStartConfig = WarmStartConfig(steps=0)
    rollout: RolloutConfig = RolloutConfig()
    rewards: RewardsConfig = RewardsConfig()
    trainer: TrainerConfig = TrainerConfig()
    critic: CriticConfig | None = None
    loop: LoopConfig = LoopConfig()
    rejection_sampling: RejectionSamplingConfig = RejectionSamplingConfig()
    iterative_dpo: IterativeDPOConfig = IterativeDPOConfig()
    environment: EnvironmentConfig | None = None
    eval: EvalConfig = EvalConfig()
    ray: RayConfig = RayConfig()
    output: OutputConfig = OutputConfig()
    # the file it was loaded from (load.load_config), for the errors of resolve.py's checks
    _source: str = PrivateAttr("the config")
    _resolved: bool = PrivateAttr(False)  # True on resolve.py's result

    @property
    def source(self) -> str:
        """The file this config was loaded from."""
        return self._source

    @property
    def resolved(self) -> bool:
        """Whether resolve.resolve made this config (fitted to a machine)."""
        return self._resolved

    def recipe(self) -> RejectionSamplingConfig | IterativeDPOConfig | None:
        """The settings of the [loop] algorithm's recipe (None for "rl", which uses [trainer])."""
        return getattr(self, self.loop.algorithm, None)

    def needs_reward_server(self) -> bool:
        """Whether the run scores with ferrule-rewards (all but environment-scored episodes)."""
        return self.environment is None or self.environment.reward != "environment"
