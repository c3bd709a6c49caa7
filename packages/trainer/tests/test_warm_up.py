"""Actor.warm_up: the passes of a step on a made-up batch, run so that compiled layers compile
before the first step (the launcher runs it beside the evaluation before RL). It must leave the
step that follows exactly as it would have been: no gradient in any `.grad`, nothing in
DeepSpeed's ZeRO-2 buckets, no optimizer state moved."""

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_trainer.batch import Batch
from ferrule_trainer.settings import EpochPlan, PolicyLoss


def _batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (4, 20), generator=generator)
    attention = torch.ones(4, 20, dtype=torch.long)
    attention[0, :5] = 0  # left padding of a short prompt
    attention[3, -3:] = 0  # right padding of a short response
    response = attention[:, -8:].clone()
    advantages = torch.randn(4, 8, generator=generator)
    return Batch(ids, attention, response, advantages=advantages)


@pytest.mark.parametrize("packed", [False, True])
def test_a_warmed_up_actor_takes_the_same_steps_as_a_cold_one(packed):
    from ferrule_trainer.actor import Actor

    common = dict(dtype="float32", zero_stage=2, seed=0, temperature=0.7, learning_rate=1e-2)
    model = tiny_model("qwen2")
    cold, warm = Actor(model, **common), Actor(model, **common)
    assert warm.warm_up(64, packed=packed, entropy=True) > 0
    assert all(p.grad is None for p in warm.module.parameters())
    plan = EpochPlan(micro_batch_size=2, pack_sequences=packed)
    loss = PolicyLoss(entropy_coef=0.01)
    for _ in range(2):  # the first step, and one after it
        expected = cold.train_epochs(_batch(), plan, loss)
        got = warm.train_epochs(_batch(), plan, loss)
        assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    after = dict(warm.module.named_parameters())
    for name, param in cold.module.named_parameters():
        torch.testing.assert_close(after[name], param, rtol=0, atol=0, msg=name)

    reference = Actor(model, train=False, dtype="float32", temperature=0.7)
    assert reference.warm_up(64, packed=packed) > 0  # its scoring pass only
