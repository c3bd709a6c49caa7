"""Losses on preference pairs: the Bradley-Terry reward-model loss and the DPO family.

    rm = reward_model_loss(chosen_scores, rejected_scores, margin=margins)    # rm.py
    dpo = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1)  # dpo.py

Every argument is a (pairs,) tensor. Each loss returns per-pair losses and detached per-pair
statistics; take the mean of the losses, or divide their sum by the step's pair count as the
trainers do. Everything is computed with logsigmoid, never with log(1 + exp(x)) or
log(sigmoid(x)): those give inf or -inf once |x| passes ~88 in float32, and then a NaN gradient.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

RM_LOSSES = ("sigmoid", "log_exp")
DPO_LOSSES = ("sigmoid", "ipo")


class RewardModelLoss(NamedTuple):
    loss: torch.Tensor  # (pairs,), carries the gradient
    margin: torch.Tensor  # (pairs,) chosen - rejected score
    correct: torch.Tensor  # (pairs,) 1.0 where the chosen response scored higher


class DPOLoss(NamedTuple):
    loss: torch.Tensor  # (pairs,), carries the gradient
    chosen_reward: torch.Tensor  # (pairs,) beta * (log pi - log pi_ref) of the chosen response
    rejected_reward: torch.Tensor  # (pairs,) the same for the rejected response
    correct: torch.Tensor  # (pairs,) 1.0 where the chosen reward is the larger


def reward_model_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    kind: str = "sigmoid",
    margin: torch.Tensor | float | None = None,
) -> RewardModelLoss:
    """The Bradley-Terry loss -log sigmoid(chosen - rejected - margin) per pair ("sigmoid", as in
    InstructGPT; the margin is Llama 2's). "log_exp", log(1 + exp(rejected - chosen + margin)),
    is the same function written the other way, offered under the name other projects use. Both
    are computed here as -logsigmoid, which is finite at any score (naive log(1 + exp(x)) is
    not)."""
    if kind not in RM_LOSSES:
        raise ValueError(f"kind must be one of {RM_LOSSES}, got {kind!r}")
    difference = chosen.float() - rejected.float()
    shifted = difference if margin is None else difference - torch.as_tensor(margin).float()
    loss = -F.logsigmoid(shifted)
    return RewardModelLoss(loss, difference.detach(), (difference > 0).float().detach())


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOLoss:
    """DPO (Rafailov et al. 2023) on log-probabilities of whole responses.

    h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
    "sigmoid":  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h); eps = label_smoothing
                > 0 is conservative DPO (cDPO: the label is wrong with probability eps).
    "ipo":      (h - 1 / (2 beta))^2 (Azar et al. 2023), which stays bounded where DPO pushes
                h to infinity; pass length-averaged log-probabilities, as its authors do.
    """
    if kind not in DPO_LOSSES:
        raise ValueError(f"kind must be one of {DPO_LOSSES}, got {kind!r}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if kind == "ipo" and label_smoothing:
        raise ValueError("label_smoothing is conservative DPO's; IPO has none")
    chosen_ratio = policy_chosen.float() - reference_chosen.float()
    rejected_ratio = policy_rejected.float() - reference_rejected.float()
    h = chosen_ratio - rejected_ratio
    if kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
            -beta * h
        )
    chosen_reward, rejected_reward = (
        (beta * chosen_ratio).detach(),
        (beta * rejected_ratio).detach(),
    )
    return DPOLoss(loss, chosen_reward, rejected_reward, (chosen_reward > rejected_reward).float())
