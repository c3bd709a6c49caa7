"""The on-policy RL step: without "old_logprobs" the training forward supplies them, and the step
is the one the explicit old log-probabilities give, with the metrics the launcher would have
computed from them."""

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_trainer import rl
from ferrule_trainer.batch import Batch
from ferrule_trainer.config import TrainerConfig
from ferrule_trainer.settings import EpochPlan, PolicyLoss


def _batch():
    generator = torch.Generator().manual_seed(0)
    B, T, R = 6, 20, 8
    ids = torch.randint(0, 500, (B, T), generator=generator)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[0, :5] = 0  # left padding of a short prompt
    attention[3, -3:] = 0  # right padding of a short response
    advantages = torch.randn(B, R, generator=generator)
    return Batch(ids, attention, attention[:, -R:].clone(), advantages=advantages), generator


def test_an_on_policy_step_equals_the_step_with_explicit_old_logprobs():
    from ferrule_trainer.actor import Actor

    model = tiny_model("qwen2")
    common = dict(dtype="float32", zero_stage=0, seed=0, temperature=0.7, learning_rate=1e-2)
    explicit, on_policy = Actor(model, **common), Actor(model, **common)
    batch, generator = _batch()
    old = explicit.logprobs(batch)
    mask = batch.response_mask
    # the engine's log-probabilities of the same tokens, a little off (and far off for one)
    rollout = old - 0.05 * torch.randn(old.shape, generator=generator)
    rollout[1, 2] = old[1, 2] - 30.0
    ref = old + 0.1 * torch.randn(old.shape, generator=generator)
    plan, loss = EpochPlan(micro_batch_size=4), PolicyLoss(kl_coef=0.05)

    with_old = explicit.train_epochs(batch.replace(old_logprobs=old, ref_logprobs=ref), plan, loss)
    without = on_policy.train_epochs(
        batch.replace(ref_logprobs=ref, rollout_logprobs=rollout), plan, loss
    )

    assert without["loss"] == pytest.approx(with_old["loss"], rel=1e-5, abs=1e-7)
    assert without["grad_norm"] == pytest.approx(with_old["grad_norm"], rel=1e-4)
    after = dict(on_policy.module.named_parameters())
    for name, param in explicit.module.named_parameters():
        torch.testing.assert_close(after[name], param, rtol=1e-5, atol=1e-6)
    # what the launcher computes from the old log-probabilities, from the training forward
    _, correction = rl.rollout_correction(old, rollout, batch)
    assert without["vllm_kl"] == pytest.approx(correction["vllm_kl"], rel=1e-4)
    assert without["kl"] == pytest.approx(rl.mean_kl(old, ref, mask), rel=1e-4, abs=1e-7)
    assert without["approx_kl"] == 0.0 and without["clip_fraction"] == 0.0  # ratio exactly 1

    with pytest.raises(ValueError, match="one optimizer step; epochs x mini_batches = 2"):
        on_policy.train_epochs(batch, EpochPlan(epochs=2, micro_batch_size=4), PolicyLoss())


@pytest.mark.parametrize(
    "settings, needed",
    [
        ({}, False),
        ({"kl_coef": 0.01}, False),  # the KL term in the loss reads the new log-probabilities
        ({"epochs": 2}, True),
        ({"mini_batches": 2}, True),
        ({"rollout_correction": "tis"}, True),
        ({"sequence_mask": [0.5, 2.0]}, True),
        (
            {
                "estimator": "reinforce_plus_plus",
                "kl_coef": 0.01,
                "kl_in": "reward",
                "kl_kind": "k1",
            },
            True,
        ),
    ],
)
def test_old_logprobs_are_needed_only_where_something_reads_them_before_training(settings, needed):
    assert TrainerConfig(**settings).needs_old_logprobs() is needed
