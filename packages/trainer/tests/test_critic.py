"""The critic learns values and saves a reloadable value model. (Reward models are ferrule-rewards'
model backend; its tests/test_model.py checks where it reads a padded sequence.)"""

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_trainer.batch import Batch
from ferrule_trainer.settings import ForwardPlan, ValueLoss


def _batch(B=4, T=16, R=6):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (B, T), generator=generator)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[0, :4] = 0
    attention[2, -2:] = 0
    return Batch(ids, attention, attention[:, -R:].clone())


def test_critic_fits_returns_and_round_trips(tmp_path):
    from transformers import AutoModelForTokenClassification

    from ferrule_trainer.critic import Critic
    from ferrule_trainer.sequences import response_values

    critic = Critic(tiny_model("qwen2"), zero_stage=2, dtype="float32", learning_rate=2e-3)
    batch = _batch().replace(returns=torch.ones(4, 6))
    losses = []
    for _ in range(6):
        batch = batch.replace(old_values=critic.values(batch))
        losses.append(critic.train_step([batch], ValueLoss(clip=None))["loss"])
    assert losses[-1] < 0.5 * losses[0], losses

    critic.save_hf(tmp_path / "critic")
    reloaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    torch.testing.assert_close(response_values(reloaded, batch), critic.values(batch))


def test_grad_norm_is_reported_the_same_at_zero_0_and_zero_2():
    from ferrule_trainer.critic import Critic

    norms = {}
    for stage in (0, 2):  # DeepSpeed itself records no norm on its plain ZeRO-0 fp32 path
        critic = Critic(tiny_model("qwen2"), zero_stage=stage, dtype="float32", learning_rate=2e-3)
        batch = _batch().replace(returns=torch.ones(4, 6))
        batch = batch.replace(old_values=critic.values(batch))
        norms[stage] = critic.train_step([batch], ValueLoss(clip=None))["grad_norm"]
    assert norms[2] > 0
    assert norms[0] == pytest.approx(norms[2], rel=1e-5)


@pytest.mark.parametrize("stage, dtype", [(0, "float32"), (2, "float32"), (2, "bfloat16")])
def test_a_non_finite_gradient_skips_the_critics_update(stage, dtype):
    """One poisoned value target: a NaN loss, the update skipped, the value model unchanged
    (ferrule_trainer.nonfinite; tests/test_nonfinite.py injects into the gradients instead)."""
    from ferrule_trainer.critic import Critic

    critic = Critic(tiny_model("qwen2"), zero_stage=stage, dtype=dtype, learning_rate=2e-3)
    batch = _batch().replace(returns=torch.ones(4, 6))
    batch = batch.replace(old_values=critic.values(batch))
    assert (
        critic.train_step([batch], ValueLoss(clip=None))["skipped"] == 0.0
    )  # a finite step goes through
    values = critic.values(batch)
    batch.returns[1, 2] = float("nan")
    result = critic.train_step([batch], ValueLoss(clip=None))
    assert result["skipped"] == 1.0
    assert result["nonfinite"] == "micro-batch 1 of 1: the loss itself is NaN"
    torch.testing.assert_close(critic.values(batch), values, rtol=0, atol=0)


def test_forward_passes_in_micro_batches_equal_the_whole_batch():
    """Policy log-probs, reference log-probs and critic values come out the same whether the
    forward takes the whole batch or micro-batches of any size (the rows carry their own padding).
    """
    from ferrule_trainer.actor import Actor
    from ferrule_trainer.critic import Critic

    batch = _batch(B=5)
    actor = Actor(tiny_model("qwen2"), zero_stage=0, dtype="float32", temperature=0.7)
    whole = actor.logprobs(batch)
    assert whole.shape == (5, 6) and whole.device.type == "cpu"
    for size in (1, 2, 3):
        torch.testing.assert_close(actor.logprobs(batch, ForwardPlan(size)), whole)
    critic = Critic(tiny_model("qwen2"), zero_stage=0, dtype="float32")
    values = critic.values(batch)
    torch.testing.assert_close(critic.values(batch, ForwardPlan(2)), values)
