"""Reward-model training on preference pairs: `rlhf-train rm config.toml`.

    [model]
    path = "models/sft"             # a causal LM (a new scalar head) or a saved reward model
    [data]
    path = "data/pairs.jsonl"       # {"prompt", "chosen", "rejected"} per line (preference.py)
    eval_path = "data/pairs_test.jsonl"
    [rm]
    loss = "sigmoid"                # Bradley-Terry (pairwise.reward_model_loss)
    [train]
    batch_size = 32                 # pairs per step
    [output]
    dir = "out/rm"                  # out/rm/model: the reward model; out/rm/state: resumable

The model is `AutoModelForSequenceClassification` with one label. The score of a sequence is
the head's output at its last token, as ferrule-rewards' model backend reads it (`rlhf-rewards
serve --model out/rm/model`). The loss is the mean over the step's pairs of -log sigmoid(chosen -
rejected - margin). Every [eval] every steps and at the end, the held-out pairs give the
pairwise accuracy and the mean margin. At the end, the mean and standard deviation of all
held-out scores are saved beside the model (reward_stats.json), for normalising at serving time.
"""

import json
import math
from pathlib import Path
from typing import Literal

import torch

from ferrule_config import Table
from ferrule_trainer import engine
from ferrule_trainer.batch import SequenceBatch
from ferrule_trainer.pairwise import reward_model_loss
from ferrule_trainer.preference import (
    PreferenceDataConfig,
    PreferenceEvalConfig,
    chosen_and_rejected,
    load_pairs,
    pair_batch,
    total_steps,
    train_pairs,
)
from ferrule_trainer.sequences import model_forward
from ferrule_trainer.sft import SFTModelConfig, SFTOutputConfig, SFTTrainConfig
from ferrule_trainer.trained import TrainedModel

STATS_FILE = "reward_stats.json"


class RMLossConfig(Table):
    """[rm]: the loss."""

    loss: Literal["sigmoid", "log_exp"] = "sigmoid"
    """"sigmoid" is -log sigmoid(chosen - rejected - margin); "log_exp" is the same function."""


class RMConfig(Table):
    """A `rlhf-train rm` run: one TOML file with these tables."""

    model: SFTModelConfig
    data: PreferenceDataConfig
    rm: RMLossConfig = RMLossConfig()
    train: SFTTrainConfig = SFTTrainConfig()
    eval: PreferenceEvalConfig = PreferenceEvalConfig()
    output: SFTOutputConfig = SFTOutputConfig(dir=Path("out/rm"))


class RewardModel(TrainedModel):
    """A sequence scorer under DeepSpeed (a causal LM's body with a one-output linear head)."""

    def __init__(self, config: RMConfig, total_steps: int):
        engine.init_distributed()
        m, t = config.model, config.train
        torch.manual_seed(t.seed)  # the new head starts the same on every rank
        self._build(
            m.path,
            kind="reward",
            zero_stage=m.zero_stage,
            dtype=m.dtype,
            max_grad_norm=t.max_grad_norm,
            learning_rate=t.learning_rate,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps,
            total_steps=total_steps,
            gradient_checkpointing=m.gradient_checkpointing,
            lora_rank=m.lora_rank,
            lora_alpha=m.lora_alpha,
            attn_implementation=m.attn_implementation,
        )
        self.pad_id = self.engine.module.config.pad_token_id

    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        """(rows,) the score of each sequence: the head's output at its last non-padding
        token."""
        output = model_forward(self.engine, dict(input_ids=batch.input_ids))  # see SequenceBatch
        return output.logits[:, 0].float()


def train(config: RMConfig, log=print) -> dict:
    """Trains as configured; returns the last held-out evaluation (accuracy, margin, mean, std)."""
    from transformers import AutoTokenizer

    engine.init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    pairs = load_pairs(config.data.path, config.data, tokenizer)
    held_out = (
        load_pairs(config.data.eval_path, config.data, tokenizer) if config.data.eval_path else []
    )
    model = RewardModel(config, total_steps(len(pairs), config.train))
    use_margin = config.data.margin_key is not None

    def pair_loss(micro_batch, step_pairs):
        chosen, rejected = chosen_and_rejected(model.scores(micro_batch))
        out = reward_model_loss(
            chosen,
            rejected,
            kind=config.rm.loss,
            margin=micro_batch.margin if use_margin else None,
        )
        metrics = {"accuracy": out.correct.mean(), "margin": out.margin.mean()}
        return out.loss.sum() / step_pairs, metrics

    def evaluate() -> dict:
        return evaluate_pairs(model, tokenizer, held_out, config) if held_out else {}

    train_pairs(
        model,
        pairs,
        tokenizer=tokenizer,
        pad_id=model.pad_id,
        config=config,
        pair_loss=pair_loss,
        evaluate=evaluate,
        log=log,
    )
    final = evaluate()
    out = Path(config.output.dir) / "model"
    model.save_hf(out)
    if torch.distributed.get_rank() == 0:
        if final:
            stats = {"mean": final["eval/score_mean"], "std": final["eval/score_std"]}
            (out / STATS_FILE).write_text(json.dumps({**stats, "pairs": len(held_out)}) + "\n")
        log(f"saved {out}" + (f": {json.dumps(final)}" if final else ""))
    return final


@torch.no_grad()
def evaluate_pairs(model: RewardModel, tokenizer, pairs, config: RMConfig) -> dict:
    """Pairwise accuracy, mean margin, and the mean and std of all scores, over `pairs`."""
    was_training = model.engine.training
    model.engine.eval()
    chosen_all, rejected_all = [], []
    try:
        for first in range(0, len(pairs), config.eval.batch_size):
            batch = pair_batch(
                tokenizer,
                pairs[first : first + config.eval.batch_size],
                config.data.max_length,
                model.pad_id,
            )
            chosen, rejected = chosen_and_rejected(model.scores(batch.to(engine.device())).cpu())
            chosen_all.append(chosen)
            rejected_all.append(rejected)
    finally:
        model.engine.train(was_training)
    chosen, rejected = torch.cat(chosen_all), torch.cat(rejected_all)
    scores = torch.cat([chosen, rejected]).double()
    return {
        "eval/accuracy": float((chosen > rejected).float().mean()),
        "eval/margin": float((chosen - rejected).mean()),
        "eval/score_mean": float(scores.mean()),
        "eval/score_std": float(scores.std()) if len(scores) > 1 else math.nan,
    }
