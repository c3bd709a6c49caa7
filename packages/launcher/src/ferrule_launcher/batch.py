"""Rollout samples to the trainer's batch layout, and the advantages of the chosen estimator.

    batch = build_batch(samples, pad_id)          # input_ids, attention_mask, response_mask
    advantages, returns = estimate(config.trainer, scores, batch, group_size=8, ...)

Samples arrive as plain data from ferrule-rollout; the layout is ferrule-trainer's
(sequences.py): left-padded prompts, right-padded responses, so every response starts at the
same column. The estimators are the trainer's pure torch functions (advantages.py, kl.py).
"""

from collections.abc import Sequence


def build_batch(samples: Sequence, pad_id: int) -> dict:
    """Tensors of the trainer's layout from rollout `Sample`s (prompt_token_ids, token_ids)."""
    import torch

    prompt_len = max(len(s.prompt_token_ids) for s in samples)
    response_len = max(max(len(s.token_ids) for s in samples), 1)
    rows = len(samples)
    input_ids = torch.full((rows, prompt_len + response_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros((rows, response_len), dtype=torch.long)
    for row, sample in enumerate(samples):
        prompt, response = sample.prompt_token_ids, sample.token_ids
        input_ids[row, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        attention_mask[row, prompt_len - len(prompt) : prompt_len] = 1
        if response:
            input_ids[row, prompt_len : prompt_len + len(response)] = torch.tensor(response)
            attention_mask[row, prompt_len : prompt_len + len(response)] = 1
            response_mask[row, : len(response)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
    }


def split(batch: dict, size: int) -> list[dict]:
    """Micro-batches of at most `size` rows (every tensor of the batch is split the same way)."""
    rows = batch["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def estimate(
    estimator: str,
    scores,
    batch: dict,
    *,
    group_size: int,
    old_logprobs=None,
    ref_logprobs=None,
    values=None,
    kl_coef: float = 0.0,
    kl_kind: str = "k1",
    kl_in: str = "loss",
    gamma: float = 1.0,
    lam: float = 0.95,
):
    """(advantages, returns) for `estimator`; returns is None except for "gae" (the critic's
    target). With kl_in = "reward" the KL of the rollout policy to the reference is a per-token
    reward penalty (PPO, REINFORCE++); otherwise the loss carries it."""
    from ferrule_trainer import advantages as adv
    from ferrule_trainer.kl import kl_estimate
    from ferrule_trainer.reward_shaping import token_rewards

    mask = batch["response_mask"]
    kl = None
    if kl_in == "reward" and kl_coef > 0:
        kl = kl_estimate(old_logprobs, ref_logprobs, mask, kind=kl_kind)
    penalty = dict(kl=kl, kl_coef=kl_coef if kl is not None else 0.0)
    if estimator == "gae":
        rewards = token_rewards(scores, mask, **penalty)
        advantages, returns = adv.gae(rewards, values, mask, gamma=gamma, lam=lam)
        return adv.normalize_advantages(advantages, mask), returns
    if estimator == "grpo":
        return adv.grpo(scores, mask, group_size=group_size), None
    if estimator == "dr_grpo":
        return adv.dr_grpo(scores, mask, group_size=group_size), None
    if estimator == "rloo":
        return adv.rloo(scores, mask, group_size=group_size), None
    if estimator == "reinforce_plus_plus":
        return adv.reinforce_plus_plus(scores, mask, gamma=gamma, **penalty), None
    if estimator == "reinforce_plus_plus_baseline":
        return (
            adv.reinforce_plus_plus_baseline(
                scores, mask, group_size=group_size, gamma=gamma, **penalty
            ),
            None,
        )
    raise ValueError(f"unknown estimator {estimator!r}")
