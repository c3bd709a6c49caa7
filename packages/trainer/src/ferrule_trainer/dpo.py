"""Direct preference optimisation on preference pairs: `rlhf-train dpo config.toml`.

    [model]
    path = "models/sft"             # the policy to train; the frozen reference is its copy
    [data]
    path = "data/pairs.jsonl"       # {"prompt", "chosen", "rejected"} per line (preference.py)
    eval_path = "data/pairs_test.jsonl"
    [dpo]
    beta = 0.1
    loss = "sigmoid"                # or "ipo"; label_smoothing > 0: conservative DPO
    nll_coef = 0.0                  # > 0 adds the chosen responses' NLL (RPO)
    [train]
    batch_size = 32                 # pairs per step
    [output]
    dir = "out/dpo"                 # out/dpo/model: the policy; out/dpo/state: resumable

The reference log-probabilities of each micro-batch are computed together with the policy's,
by a frozen copy of the starting model (no optimizer; ZeRO-3 shards it like the policy). The loss
is pairwise.dpo_loss on the summed log-probabilities of the response tokens (IPO: their mean per
token), averaged over the step's pairs, plus nll_coef times the mean NLL per chosen response
token. The metrics are the loss, accuracy (chosen reward > rejected), the reward margin, and the
chosen / rejected rewards and log-probabilities. They are also computed on the held-out pairs
every [eval] every steps and at the end.
"""

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from ferrule_config import Problems, Table
from ferrule_trainer import engine
from ferrule_trainer.batch import SequenceBatch
from ferrule_trainer.pairwise import dpo_loss
from ferrule_trainer.preference import (
    PreferenceDataConfig,
    PreferenceEvalConfig,
    chosen_and_rejected,
    load_pairs,
    pair_batch,
    total_steps,
    train_pairs,
)
from ferrule_trainer.sequences import model_forward, token_logprobs
from ferrule_trainer.sft import SFTModelConfig, SFTOutputConfig, SFTTrainConfig


class DPOLossConfig(Table):
    """[dpo]: the objective."""

    beta: float = Field(0.1, gt=0)
    """Strength of the pull toward the reference (the KL coefficient of the implicit reward)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """"sigmoid" (DPO) or "ipo" (squared loss on length-averaged log-ratios)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO: the assumed probability that a pair's label is wrong (sigmoid only)."""
    nll_coef: float = Field(0.0, ge=0)
    """Weight of the chosen responses' per-token NLL added to the loss (0: none)."""

    @model_validator(mode="after")
    def _smoothing_is_dpo_only(self):
        if self.loss == "ipo" and self.label_smoothing:
            raise Problems([("label_smoothing", "is conservative DPO's; IPO has none")])
        return self


class DPOConfig(Table):
    """A `rlhf-train dpo` run: one TOML file with these tables."""

    model: SFTModelConfig
    data: PreferenceDataConfig
    dpo: DPOLossConfig = DPOLossConfig()
    train: SFTTrainConfig = SFTTrainConfig()
    eval: PreferenceEvalConfig = PreferenceEvalConfig()
    output: SFTOutputConfig = SFTOutputConfig(dir=Path("out/dpo"))


def response_logprobs(model, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows,) the summed log-probability of each sequence's response tokens, and their count."""
    # no attention mask (see SequenceBatch)
    logits = model_forward(model, dict(input_ids=batch.input_ids)).logits[:, :-1]
    per_token = token_logprobs(logits, batch.input_ids[:, 1:])
    mask = batch.loss_mask[:, 1:].float()
    return (per_token * mask).sum(-1), mask.sum(-1)


def dpo_pair_loss(policy, reference, micro_batch: SequenceBatch, step_pairs: int, d: DPOLossConfig):
    """Returns a micro-batch's share of the step's DPO loss (the mean over the step's
    `step_pairs` pairs) and the micro-batch's metrics. `policy` and `reference` are the models
    (DeepSpeed engines)."""
    with torch.no_grad():
        reference.eval()
        ref_sums, counts = response_logprobs(reference, micro_batch)
    sums, counts = response_logprobs(policy, micro_batch)
    per_token = d.loss == "ipo"  # IPO compares length-averaged log-probabilities
    scale = counts.clamp(min=1) if per_token else 1.0
    (pc, pr), (rc, rr) = chosen_and_rejected(sums / scale), chosen_and_rejected(ref_sums / scale)
    out = dpo_loss(pc, pr, rc, rr, beta=d.beta, kind=d.loss, label_smoothing=d.label_smoothing)
    loss = out.loss.sum() / step_pairs
    chosen_sums, rejected_sums = chosen_and_rejected(sums)
    if d.nll_coef:  # each chosen response's mean NLL per token, averaged over the step's pairs
        chosen_nll = -chosen_sums / chosen_and_rejected(counts)[0].clamp(min=1)
        loss = loss + d.nll_coef * chosen_nll.sum() / step_pairs
    metrics = {
        "accuracy": out.correct.mean(),
        "margin": (out.chosen_reward - out.rejected_reward).mean(),
        "chosen_reward": out.chosen_reward.mean(),
        "rejected_reward": out.rejected_reward.mean(),
        "chosen_logp": chosen_sums.detach().mean(),
        "rejected_logp": rejected_sums.detach().mean(),
    }
    return loss, metrics


def train(config: DPOConfig, log=print) -> dict:
    """Trains as configured; returns the last held-out evaluation (empty without eval_path)."""
    from transformers import AutoTokenizer

    from ferrule_trainer.actor import Actor

    d = config.dpo
    engine.init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    pairs = load_pairs(config.data.path, config.data, tokenizer)
    held_out = (
        load_pairs(config.data.eval_path, config.data, tokenizer) if config.data.eval_path else []
    )
    m, t = config.model, config.train
    common = dict(dtype=m.dtype, attn_implementation=m.attn_implementation, seed=t.seed)
    policy = Actor(
        m.path,
        zero_stage=m.zero_stage,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        warmup_steps=t.warmup_steps,
        total_steps=total_steps(len(pairs), t),
        gradient_checkpointing=m.gradient_checkpointing,
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        **common,
    )
    reference = Actor(m.path, train=False, zero_stage=m.zero_stage, **common)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )

    def pair_loss(micro_batch, step_pairs):
        return dpo_pair_loss(policy.engine, reference.engine, micro_batch, step_pairs, d)

    @torch.no_grad()
    def evaluate() -> dict:
        if not held_out:
            return {}
        policy.engine.eval()
        totals: dict[str, float] = {}
        try:
            for first in range(0, len(held_out), config.eval.batch_size):
                chunk = held_out[first : first + config.eval.batch_size]
                batch = pair_batch(tokenizer, chunk, config.data.max_length, pad_id)
                batch = batch.to(engine.device())
                loss, metrics = pair_loss(batch, len(held_out))
                for key, value in {"loss": loss, **metrics}.items():
                    weight = 1.0 if key == "loss" else len(chunk) / len(held_out)
                    totals[key] = totals.get(key, 0.0) + float(value) * weight
        finally:
            policy.engine.train()
        return {f"eval/{k}": v for k, v in totals.items()}

    train_pairs(
        policy,
        pairs,
        tokenizer=tokenizer,
        pad_id=pad_id,
        config=config,
        pair_loss=pair_loss,
        evaluate=evaluate,
        log=log,
    )
    final = evaluate()
    out = Path(config.output.dir) / "model"
    policy.save_hf(out)
    if torch.distributed.get_rank() == 0:
        log(f"saved {out}" + (f": {final}" if final else ""))
    return final
