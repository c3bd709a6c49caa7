"""The trainer's config tables: [model], [trainer], [critic] (ferrule_config reads the files).

    config = load_config("sft.toml", SFTConfig)    # ferrule_config: errors name file, table, key

pydantic is imported here, not torch.
"""

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, model_validator

from ferrule_config import InputPath, Problems, Table, renamed_dtype
from ferrule_trainer.settings import Correction, EpochPlan, ForwardPlan, PolicyLoss

TrainDType = Annotated[Literal["float32", "bfloat16"], BeforeValidator(renamed_dtype)]
"""Every Ferrule table names dtypes as torch does; training accepts these two."""

ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gae",
)
LORA_TARGETS = (  # every linear layer of the decoder, as OpenRLHF defaults to
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The attention and MLP projections of Llama / Qwen-style models."""

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
"""Estimators that compare the samples of one prompt: they need >= 2 samples per prompt."""


# -- the trainer's tables ------------------------------------------------------------------------


def _has_model(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ValueError(f"no Hugging Face model at {path} (config.json missing)")
    return path


class ModelConfig(Table):
    """[model]: the model every role starts from."""

    path: Annotated[InputPath, AfterValidator(_has_model)]
    """Hugging Face model directory (config, weights, tokenizer), relative to the TOML file."""
    dtype: TrainDType = "float32"
    """"float32" or "bfloat16" (use float32 on CPUs without bf16 instructions)."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None
    """The transformers attention kernel of the trained and frozen models (None: the default)."""
    compile_layers: bool = True
    """Run each decoder layer of the policy, the reference and the critic through torch.compile.
    Training at 1.5B on an H100 is ~18% faster, after a first step that compiles. Applies only
    on CUDA below ZeRO-3. Elsewhere, with [rollout] exact and with [trainer] sequence_parallel
    above 1, the layers run eagerly."""


GSPO_AGG_MODE = "seq-mean-token-mean"
AUTO_KEYS = (
    "micro_batch_tokens",
    "forward_batch_tokens",
    "zero_stage",
    "gradient_checkpointing",
    "offload_optimizer",
    "offload_params",
    "offload_between_phases",
    "sequence_parallel",
)
"""[trainer] keys that default to "auto": the memory plan's choice."""


class TrainerConfig(Table):
    """[trainer]: the policy's optimisation (the RL step: rl.py)."""

    estimator: Literal[ESTIMATORS] = "grpo"  # type: ignore[valid-type]
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline,
    or gae (PPO with a critic; needs [critic])."""
    learning_rate: float = Field(1e-4, gt=0)
    """Actor learning rate (AdamW)."""
    ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel ranks of the policy (DeepSpeed). Each rank is one Ray actor in one bundle."""
    reference_ranks: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = "auto"
    """Data-parallel ranks of the reference (used when kl_coef > 0). With zero_stage = 3 the
    reference's weights are sharded over these ranks, so a large reference need not fit on one
    device. "auto": on GPUs where the reference shares the policy's bundles (placement
    "colocate_all" or "colocate"), one reference rank beside each policy rank, so that each GPU
    scores its own samples. Otherwise one sequence group (sequence_parallel ranks)."""
    sequence_parallel: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    """Ranks that share each sequence (DeepSpeed-Ulysses style: ferrule_trainer's
    sequence_parallel.py). The ranks of the policy, the reference and the critic form groups of
    this many consecutive ranks. A group's ranks take the same rows, and each runs the model on
    1/N of every row's positions, so a sequence's activations are split N ways. ranks,
    reference_ranks, [critic] ranks and the model's attention heads must be multiples of it.
    Above 1, the layers run uncompiled ([model] compile_layers is not applied). "auto": 1 on
    CPU. On GPUs the memory plan chooses, and it goes above 1 only when no plan with one rank
    per sequence fits."""
    epochs: int = Field(1, ge=1)
    """PPO epochs: optimizer passes over each rollout batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch (the rollout batch is split into this many)."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward, at most (micro_batch_tokens may take fewer)."""
    forward_batch_size: int | None = Field(None, ge=1)
    """Sequences per forward pass of the old-policy, reference and value passes, at most (None:
    micro_batch_size). The logits of a pass grow with it: rows x response length x vocabulary."""
    micro_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] | None = "auto"
    """The most tokens per forward/backward of the policy and the critic. Each mini-batch's
    sequences are sorted by length into micro-batches of up to micro_batch_size rows. A
    micro-batch's rows x padded length (or, when packed, its token count) stays within this
    budget. Activations grow
    with tokens, not rows: 64 rows of ~270 tokens (17k) ran a 1.5B policy out of memory on an
    H100 beside its engine, while 16 rows (4.3k) fit. A sequence longer than this goes alone.
    The loss is the same however the step is split. "auto": on GPUs the largest that fits the
    memory plan (`rlhf-launch --plan`), elsewhere 8192. "none": micro_batch_size rows in batch
    order."""
    forward_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] | None = "auto"
    """The most tokens per forward of the old-policy, reference and value passes, counted as for
    micro_batch_tokens, in at most forward_batch_size rows (None: micro_batch_tokens). "auto":
    on GPUs, what the memory plan fits (a smaller reference pass can make offloading the policy
    between phases unnecessary); elsewhere None."""
    pack_sequences: bool = False
    """Pack each micro-batch's sequences into one row without padding, within
    micro_batch_tokens / forward_batch_tokens real tokens. Positions restart at 0 with each
    sequence. From these positions, transformers' sdpa and eager attention build a document
    mask (no token attends across sequences), and flash attention runs variable-length kernels.
    Works for models whose attention masks come from transformers' masking utilities (Llama,
    Qwen2, Mistral, ...). The log-probabilities equal the padded ones up to rounding."""
    clip_low: float = Field(0.2, ge=0)
    """PPO ratio clip below 1."""
    clip_high: float = Field(0.28, ge=0)
    """PPO ratio clip above 1 (DAPO's clip-higher)."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (None: off)."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses are reduced: over the step's valid tokens, or per sequence and then
    over the sequences that have a valid token (aggregation.py; verl's names)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL(policy || reference) coefficient; > 0 starts the reference model."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (k1 belongs in the reward, k2 / k3 in the loss)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL goes: a loss term (GRPO) or a per-token reward penalty (PPO, REINFORCE++)."""
    kl_max: float | None = Field(10.0, gt=0)
    """Cap on each token's KL estimate, in the loss and in the reward. With it, one token that
    the policy gives almost no probability cannot decide a batch; a capped token adds kl_max and
    no gradient. None: off."""
    kl_target: float | None = Field(None, gt=0)
    """Adaptive KL (Ziegler et al. 2019): the per-token KL to the reference to steer towards.
    kl_coef is the starting coefficient, and it moves by at most 20% per kl_horizon samples
    (None: kl_coef stays fixed)."""
    kl_horizon: int = Field(10000, ge=1)
    """Adaptive KL: samples over which the coefficient may move by 20%."""
    reward_norm: Literal["none", "batch", "running"] = "none"
    """Normalise the scores before the estimator: "batch" by this batch's mean and std,
    "running" by those of every score so far (checkpointed)."""
    reward_clip: float | None = Field(None, gt=0)
    """Clip the (normalised) scores to [-reward_clip, reward_clip] (None: off)."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO's soft overlong penalty. A response longer than [rollout] max_tokens minus this many
    tokens loses up to overlong_penalty from its score. The penalty grows linearly and reaches
    overlong_penalty at max_tokens (None: off)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The largest overlong penalty."""
    truncated_score: float | None = None
    """The score given to a response cut off at max_tokens (finish reason "length"), in place of
    both the reward function's score and the overlong penalty (None: not replaced)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The PPO ratio per token, or per response. "sequence" is GSPO (use clip_low / clip_high
    ~3e-4 / 4e-4, as in its paper); it sets agg_mode = "seq-mean-token-mean" and refuses any
    other agg_mode."""
    rollout_correction: Literal["none", "tis", "icepop"] = "none"
    """Weight each token's loss by pi_trainer / pi_engine of the sampled token, because the
    engine's and the trainer's probabilities differ: "tis" truncates the ratio to [tis_floor,
    tis_cap]; "icepop" drops tokens whose ratio is outside [icepop_low, icepop_high]. The metric
    vllm_kl (KL between the two, per token) is logged every step either way."""
    tis_cap: float = Field(2.0, gt=0)
    """TIS: the largest weight."""
    tis_floor: float | None = Field(None, ge=0)
    """TIS: the smallest weight (None: 0)."""
    icepop_low: float = Field(0.5, ge=0)
    """IcePop: tokens with a ratio below this are dropped from the gradient."""
    icepop_high: float = Field(5.0, gt=0)
    """IcePop: tokens with a ratio above this are dropped from the gradient."""
    sequence_mask: tuple[float, float] | None = None
    """[low, high]: drop whole responses whose geometric-mean ratio pi_trainer / pi_engine is
    outside this range. Works with or without a token-level correction (None: off)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount of the per-token returns (gae, reinforce_plus_plus*)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    lora_rank: int = Field(0, ge=0)
    """Train LoRA adapters of this rank on lora_targets instead of the whole policy (0: full
    fine-tuning). The engines receive the merged weights. The final policy is saved merged,
    and the adapter is saved under policy/adapter."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scale numerator: the update is (lora_alpha / lora_rank) B A."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Module names (suffixes) that get adapters."""
    zero_stage: Annotated[int, Field(ge=0, le=3)] | Literal["auto"] = "auto"
    """DeepSpeed ZeRO stage (3 also shards the parameters over the policy's ranks). "auto": on
    GPUs, the fastest stage that fits the memory plan (2 before 3). Elsewhere 0, or 2 with an
    offload (3 with offload_params)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""
    max_skipped_steps: int = Field(3, ge=1)
    """A step whose gradients hold a NaN or an inf is skipped: the weights, the optimizer state
    and the learning rate do not change. train/skipped counts such steps, and the log says where
    the values arose. The run stops at this many skipped steps in a row (policy or critic)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (policy and critic)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (policy and critic)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warm-up."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to a tenth of the peak over the run's optimizer
    steps (loop steps x epochs x mini_batches)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward (policy and critic): less memory, ~1/3 more compute.
    "auto": on only where the memory plan needs it (off on CPU)."""
    offload_optimizer: bool | Literal["auto"] = "auto"
    """DeepSpeed keeps optimizer states in host memory and steps on the CPU (on GPUs, ZeRO >= 1).
    "auto": only where the memory plan needs it (off on CPU)."""
    offload_params: bool | Literal["auto"] = "auto"
    """DeepSpeed keeps parameters in host memory (on GPUs, ZeRO-3). "auto": only where the
    memory plan needs it (off on CPU)."""
    offload_between_phases: bool | Literal["auto"] = "auto"
    """Hybrid engine: move the policy's (and the critic's) optimizer states, gradients and
    weights to host memory while the rollout engines generate on the same GPUs, and back for
    training. Needs placement "colocate_all", loop mode "sync" and ZeRO >= 1 (on CPU there is
    nothing to move). "auto": only where the memory plan needs it (off on CPU)."""

    _auto: frozenset[str] = PrivateAttr(frozenset())
    _reference_ranks_auto: bool = PrivateAttr(False)

    @property
    def auto(self) -> frozenset[str]:
        """The keys left to the memory plan ("auto"). They now hold the CPU defaults, which
        ferrule-launcher's plan replaces on GPUs."""
        return self._auto

    @property
    def reference_ranks_auto(self) -> bool:
        """Whether reference_ranks was left "auto". It now holds one sequence group
        (sequence_parallel ranks); ferrule-launcher places GPU runs."""
        return self._reference_ranks_auto

    @model_validator(mode="after")
    def _cpu_defaults(self):
        """Sets the "auto" keys to what a run without GPUs uses (the launcher plans GPU runs):
        the ZeRO stage follows the offloads the user chose, and everything else is off."""
        offloads = [self.offload_optimizer, self.offload_params, self.offload_between_phases]
        defaults = {
            "micro_batch_tokens": 8192,
            "forward_batch_tokens": None,
            "zero_stage": 3 if self.offload_params is True else 2 if True in offloads else 0,
            "gradient_checkpointing": False,
            "offload_optimizer": False,
            "offload_params": False,
            "offload_between_phases": False,
            "sequence_parallel": 1,
        }
        auto = frozenset(key for key in AUTO_KEYS if getattr(self, key) == "auto")
        for key in auto:
            object.__setattr__(self, key, defaults[key])  # frozen, but this is its own validation
        self._auto = auto
        self._reference_ranks_auto = self.reference_ranks == "auto"
        if self._reference_ranks_auto:  # one sequence group
            object.__setattr__(self, "reference_ranks", self.sequence_parallel)
        return self

    @model_validator(mode="before")
    @classmethod
    def _gspo_aggregation(cls, data):
        """GSPO is a per-sequence objective: its loss is the mean over sequences of each
        sequence's token mean. With that aggregation it agrees exactly with OpenRLHF's and
        verl's GSPO (value and gradient, checked on 100 seeds); under the default token-mean it
        does not (1.03 in value, 0.77 in gradient on the same inputs). So ratio_level =
        "sequence" brings that aggregation as agg_mode's default."""
        if isinstance(data, dict) and data.get("ratio_level") == "sequence":
            data = {"agg_mode": GSPO_AGG_MODE, **data}
        return data

    @model_validator(mode="after")
    def _estimator_rules(self):
        problems = []
        if self.ratio_level == "sequence" and self.agg_mode != GSPO_AGG_MODE:
            problems.append(
                (
                    "agg_mode",
                    f'ratio_level = "sequence" (GSPO) is defined with agg_mode = '
                    f'"{GSPO_AGG_MODE}" (its default); got {self.agg_mode!r}',
                )
            )
        if self.kl_in == "reward" and self.estimator in ("grpo", "dr_grpo", "rloo"):
            problems.append(
                ("kl_in", f'"reward" is not supported by estimator {self.estimator!r}; use "loss"')
            )
        if not self.betas[0] < 1 or not self.betas[1] < 1 or min(self.betas) < 0:
            problems.append(("betas", f"must both be in [0, 1), got {list(self.betas)}"))
        problems += self.offload_problems()
        for key in ("ranks", "reference_ranks"):
            if getattr(self, key) % self.sequence_parallel:
                problems.append(
                    (
                        key,
                        f"must be a multiple of sequence_parallel = {self.sequence_parallel} "
                        f"(groups of ranks share each sequence), got {getattr(self, key)}",
                    )
                )
        if self.lora_rank and not self.lora_targets:
            problems.append(("lora_targets", "needs at least one module name"))
        if self.kl_target is not None and self.kl_coef == 0:
            problems.append(("kl_target", "needs kl_coef > 0: the coefficient it starts from"))
        if self.tis_floor is not None and self.tis_floor >= self.tis_cap:
            problems.append(("tis_floor", f"must be below tis_cap = {self.tis_cap:g}"))
        if self.icepop_low >= self.icepop_high:
            problems.append(("icepop_low", f"must be below icepop_high = {self.icepop_high:g}"))
        if self.sequence_mask is not None and not (
            0 <= self.sequence_mask[0] < 1 < self.sequence_mask[1]
        ):
            problems.append(
                ("sequence_mask", f"needs 0 <= low < 1 < high, got {list(self.sequence_mask)}")
            )
        if self.kl_in == "loss" and self.kl_coef > 0 and self.kl_kind == "k1":
            problems.append(
                (
                    "kl_kind",
                    '"k1" has zero gradient in expectation as a loss term; use "k2" or "k3", '
                    'or kl_in = "reward"',
                )
            )
        if problems:
            raise Problems(problems)
        return self

    def offload_problems(self) -> list[tuple[str, str]]:
        """The offloads' requirements on the ZeRO stage that this config breaks (the memory plan
        skips choices with any)."""
        problems = []
        if self.offload_params and self.zero_stage != 3:
            problems.append(("offload_params", "needs zero_stage = 3 (only ZeRO-3 shards them)"))
        if (self.offload_optimizer or self.offload_between_phases) and self.zero_stage == 0:
            key = "offload_optimizer" if self.offload_optimizer else "offload_between_phases"
            problems.append((key, "needs zero_stage >= 1 (ZeRO-0 keeps a plain optimizer)"))
        return problems

    def optimizer_options(self, rl_steps: int, learning_rate: float | None = None) -> dict:
        """The keyword arguments of `Actor` / `Critic` for a trained model (the critic passes
        its own learning rate) over `rl_steps` RL steps."""
        options = self.model_dump(
            include={
                "zero_stage",
                "max_grad_norm",
                "weight_decay",
                "betas",
                "warmup_steps",
                "gradient_checkpointing",
                "offload_optimizer",
                "offload_params",
            }
        )
        options["learning_rate"] = learning_rate or self.learning_rate
        steps = rl_steps * self.epochs * self.mini_batches
        options["total_steps"] = steps if self.lr_schedule == "cosine" else None
        return options

    def lora_options(self) -> dict:
        """The LoRA keyword arguments of the policy's `Actor`."""
        return self.model_dump(include={"lora_rank", "lora_alpha", "lora_targets"})

    def batch_multiple(self, critic: "CriticConfig | None") -> int:
        """The rollout batch must be a multiple of this many rows: every rank of the policy,
        the reference and the critic takes an equal share of every (mini-)batch."""
        multiple = self.ranks * self.mini_batches
        if self.kl_coef > 0:
            multiple = math.lcm(multiple, self.reference_ranks)
        if critic is not None:
            multiple = math.lcm(multiple, critic.ranks * self.mini_batches)
        return multiple

    def needs_old_logprobs(self) -> bool:
        """Whether the RL step needs the policy's log-probabilities from before it trains
        ("old"). They are read by a batch trained in more than one optimizer step, by rollout
        correction's weights and by a KL penalty in the reward. Otherwise the first training
        forward runs at the same weights, and `Actor.train_step` takes them from that forward,
        saving a forward pass per step."""
        return (
            self.epochs * self.mini_batches > 1
            or self.rollout_correction != "none"
            or self.sequence_mask is not None
            or (self.kl_in == "reward" and self.kl_coef > 0)
        )

    def correction(self) -> Correction:
        """What `rl.rollout_correction` does with the engine's and the trainer's logprobs."""
        return Correction(
            kind=self.rollout_correction,
            tis_cap=self.tis_cap,
            tis_floor=self.tis_floor,
            icepop_low=self.icepop_low,
            icepop_high=self.icepop_high,
            sequence_mask=self.sequence_mask,
        )

    def epoch_plan(self) -> EpochPlan:
        """How the policy and the critic train on each batch (`rl.ppo_epochs`)."""
        return EpochPlan(
            epochs=self.epochs,
            mini_batches=self.mini_batches,
            micro_batch_size=self.micro_batch_size,
            micro_batch_tokens=self.micro_batch_tokens,
            pack_sequences=self.pack_sequences,
        )

    def forward_plan(self) -> ForwardPlan:
        """How the old policy's, the reference's and the critic's scoring passes take a batch
        (forward_batch_size / _tokens, else the training micro-batch's)."""
        return ForwardPlan(
            micro_batch_size=self.forward_batch_size or self.micro_batch_size,
            micro_batch_tokens=self.forward_batch_tokens or self.micro_batch_tokens,
            packed=self.pack_sequences,
        )

    def policy_loss(self, kl_coef: float | None = None) -> PolicyLoss:
        """The policy loss's settings. The KL term is included only when the loss carries it
        (kl_in = "loss"), with coefficient `kl_coef` (the adaptive controller's; None: this
        table's)."""
        in_loss = self.kl_in == "loss"
        return PolicyLoss(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            agg_mode=self.agg_mode,
            kl_coef=(self.kl_coef if kl_coef is None else kl_coef) if in_loss else 0.0,
            kl_kind=self.kl_kind,
            kl_max=self.kl_max,
            ratio_level=self.ratio_level,
            entropy_coef=self.entropy_coef,
        )


class CriticConfig(Table):
    """[critic]: the value model of PPO (estimator "gae"), under [trainer]'s DeepSpeed settings."""

    ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel ranks of the critic; with [trainer] zero_stage = 3 its weights and
    optimizer states are sharded over them."""
    learning_rate: float = Field(1e-4, gt=0)
    """Critic learning rate (AdamW)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the value update around the old values (None: off)."""
    init: Literal["policy", "reward_model"] = "policy"
    """"policy" starts the critic from the policy's weights with a new value head.
    "reward_model" starts it from the body and scalar head of the reward model that the run
    scores with (classic RLHF's critic)."""


class RejectionSamplingConfig(Table):
    """[rejection_sampling]: [loop] algorithm = "rejection_sampling" (SFT on each prompt's best
    sample by reward, best-of-n)."""

    chosen_min_reward: float | None = None
    """A prompt's best sample is trained on only when its reward reaches this (none: always).
    With a partial-credit reward, the best of n samples is often still wrong, and training on it
    teaches the error."""


class IterativeDPOConfig(Table):
    """[iterative_dpo]: [loop] algorithm = "iterative_dpo" (DPO on each prompt's best and worst
    sample as a pair, against the starting model as the reference)."""

    beta: float = Field(0.1, gt=0)
    """DPO's beta."""
    nll_coef: float = Field(0.0, ge=0)
    """Weight of the chosen samples' mean NLL per token added to the loss (RPO; 0: plain DPO,
    which may lower the likelihood of the chosen samples too)."""
    chosen_min_reward: float | None = None
    """A prompt's best sample is the chosen side of a pair only when its reward reaches this;
    none: always."""


def rl_batch_problems(
    trainer: TrainerConfig, critic: CriticConfig | None, samples_per_prompt: int, batch: int
) -> list[tuple[str, str]]:
    """What the RL step needs of the rollout batch and the [critic] table, as (table.key,
    message) problems: group estimators compare samples of a prompt, gae needs a critic, and
    every rank takes an equal share of every mini-batch."""
    problems = []
    if trainer.estimator in GROUP_ESTIMATORS and samples_per_prompt < 2:
        problems.append(
            (
                "rollout.samples_per_prompt",
                f"must be >= 2 for estimator {trainer.estimator!r} (it compares samples of a "
                f"prompt), got {samples_per_prompt}",
            )
        )
    if trainer.kl_target is not None and batch >= 5 * trainer.kl_horizon:
        problems.append(
            (
                "trainer.kl_horizon",
                f"must exceed the rollout batch / 5 = {batch / 5:g} samples: one step may move "
                f"the KL coefficient by 20% x batch / kl_horizon, and past 100% it turns "
                f"negative; got {trainer.kl_horizon}",
            )
        )
    if trainer.estimator == "gae" and critic is None:
        problems.append(("trainer.estimator", '"gae" needs a [critic] table'))
    if trainer.estimator != "gae" and critic is not None:
        problems.append(
            (
                "critic.learning_rate",
                f'a [critic] is only used by estimator "gae", not {trainer.estimator!r}: '
                "remove the table",
            )
        )
    if batch % (trainer.mini_batches * trainer.ranks):
        problems.append(
            (
                "trainer.mini_batches" if batch % trainer.mini_batches else "trainer.ranks",
                f"mini_batches x ranks must divide the rollout batch (prompts_per_step x "
                f"samples_per_prompt = {batch}), got {trainer.mini_batches} x {trainer.ranks}",
            )
        )
    elif trainer.kl_coef > 0 and batch % trainer.reference_ranks:
        problems.append(
            (
                "trainer.reference_ranks",
                f"must divide the rollout batch {batch}, got {trainer.reference_ranks}",
            )
        )
    elif critic is not None and batch % (trainer.mini_batches * critic.ranks):
        problems.append(
            (
                "critic.ranks",
                f"[trainer] mini_batches x ranks must divide the rollout batch {batch}, got "
                f"{trainer.mini_batches} x {critic.ranks}",
            )
        )
    return problems
