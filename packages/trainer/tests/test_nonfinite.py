"""A step whose gradients hold a NaN or an inf is skipped, on every DeepSpeed path we use: the
weights, the optimizer's states and the learning-rate schedule stay as they were (a run that
skips the bad step ends bit for bit where a run that never saw it ends), the step says where the
values arose, and the RL step stops the run at [trainer] max_skipped_steps in a row.

The values are injected into the backward pass, under a finite loss, as a GPU kernel's NaN
arrives: a hook on one decoder layer's MLP output poisons one element of its gradient."""

from dataclasses import dataclass

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_trainer.batch import Batch
from ferrule_trainer.config import CriticConfig, TrainerConfig
from ferrule_trainer.groups import Group
from ferrule_trainer.nonfinite import NonFiniteGradientError, SkippedSteps
from ferrule_trainer.ranks import LocalRanks
from ferrule_trainer.step import RLStep

POISONED = "layers.1.mlp"  # the module whose output gradient gets the value


def _micro_batches(seed: int, rows: int = 4, length: int = 12, response: int = 5) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 400, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as a real batch has
    response_mask = mask[:, -response:].clone()
    response_mask[1, -2:] = 0
    advantages = torch.randn(rows, response, generator=g)
    batch = Batch(ids, mask, response_mask, advantages=advantages)
    return [batch.take([0, 1]), batch.take([2, 3])]


class Poison:
    """Adds `value` to one element of `module`'s output gradient while `armed`."""

    def __init__(self, module: torch.nn.Module, value: float):
        self.value, self.armed = value, False
        module.register_forward_hook(self._forward)

    def _forward(self, module, inputs, output):
        if self.armed and output.requires_grad:
            output.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[7] += self.value
        return grad


def _actor(stage: int, dtype: str):
    from ferrule_trainer.actor import Actor

    return Actor(tiny_model("qwen2"), zero_stage=stage, dtype=dtype, learning_rate=1e-2)


def _poison(actor, value: float) -> Poison:
    (module,) = [m for name, m in actor.engine.module.named_modules() if name.endswith(POISONED)]
    return Poison(module, value)


PATHS = [(0, "float32"), (0, "bfloat16"), (2, "float32"), (2, "bfloat16"), (3, "float32")]


@pytest.mark.parametrize("stage, dtype", PATHS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_update_is_skipped_and_changes_nothing(stage, dtype, value):
    """Two runs from the same weights: one takes a good step, a poisoned step (skipped) and a
    second good step; the other only the two good steps. Same weights bit for bit: the skipped
    update moved no weight, no Adam moment and no learning-rate step."""
    skipping, clean = _actor(stage, dtype), _actor(stage, dtype)
    poison = _poison(skipping, value)
    first, bad, second = _micro_batches(0), _micro_batches(1), _micro_batches(2)

    assert skipping.train_step(first)["skipped"] == 0.0
    before = skipping.weights_digest()
    poison.armed = True
    result = skipping.train_step(bad)
    poison.armed = False
    assert result["skipped"] == 1.0
    assert skipping.weights_digest() == before
    assert skipping.train_step(second)["skipped"] == 0.0

    clean.train_step(first)
    clean.train_step(second)
    assert skipping.weights_digest() == clean.weights_digest()

    where = result["nonfinite"]
    if stage == 3:  # not replayed: each forward gathers the parameters with the other ranks
        assert where == ""
        return
    kind = "NaN" if value != value else "inf"
    assert where.startswith("micro-batch 1 of 2: ") and kind in where, where
    assert "nearest the output in model.layers.1 (" in where and "mlp.down_proj" in where
    assert where.endswith("the loss finite"), where


def test_a_non_finite_loss_is_located_as_the_loss():
    actor = _actor(2, "float32")
    micro_batches = _micro_batches(0)
    micro_batches[1].advantages[0, 0] = float("nan")
    result = actor.train_step(micro_batches)
    assert result["skipped"] == 1.0
    assert result["nonfinite"] == "micro-batch 2 of 2: the loss itself is NaN"


def test_skipped_steps_stop_the_run_only_in_a_row():
    skips = SkippedSteps(3, "critic")
    bad = {"skipped": 1.0, "nonfinite": "micro-batch 2 of 5: inf in the gradients of 3 ..."}
    for step, metrics in enumerate([bad, bad, {"skipped": 0.0}, bad, bad], start=1):
        skips.count(step, metrics)  # two, a good step, two: never three in a row
    with pytest.raises(NonFiniteGradientError) as caught:
        skips.count(6, bad)
    message = str(caught.value)
    for part in ("critic", "3 steps in a row", "step 6", "max_skipped_steps = 3", "micro-batch 2"):
        assert part in message, message
    assert "compile_layers = false" in message and "learning_rate" in message


@dataclass
class Sample:  # the fields of ferrule-rollout's Sample that a step reads
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int = 0
    finish_reason: str = "stop"


def _samples(step: int, count: int = 8) -> list[Sample]:
    """A batch for RL step `step`: made by the policy of version step - 1."""
    g = torch.Generator().manual_seed(step)
    return [
        Sample(
            torch.randint(5, 400, (3 + i % 3,), generator=g).tolist(),
            tokens := torch.randint(5, 400, (2 + i % 4,), generator=g).tolist(),
            [-1.0] * len(tokens),
            version=step - 1,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("role", ["policy", "critic"])
def test_the_rl_step_counts_skips_and_stops_at_max_skipped_steps(role):
    """Real Actor / Critic ranks in process; the role's gradients poisoned from step 2 on: steps
    2 and 3 are skipped (train/skipped or critic/skipped, the policy's weights unchanged) and
    step 4, the third in a row, stops the run with the role named."""
    from ferrule_trainer.critic import Critic

    policy = _actor(0, "float32")
    critic = Critic(tiny_model("qwen2"), zero_stage=0, dtype="float32", learning_rate=1e-3)
    trainer = TrainerConfig(estimator="gae", micro_batch_size=4, max_skipped_steps=3)
    step = RLStep(
        trainer,
        CriticConfig(),
        group_size=4,
        pad_id=0,
        policy=LocalRanks(policy),
        critic_ranks=LocalRanks(critic),
    )
    poison = _poison(policy if role == "policy" else critic, float("nan"))
    prefix = "train" if role == "policy" else "critic"
    assert step.train(1, Group.split(_samples(1), [0.0, 1.0] * 4, 4))[f"{prefix}/skipped"] == 0.0
    poison.armed = True
    for number in (2, 3):
        before = policy.weights_digest()
        metrics = step.train(number, Group.split(_samples(number), [0.0, 1.0] * 4, 4))
        assert metrics[f"{prefix}/skipped"] == 1.0 and "NaN" in metrics[f"{prefix}/nonfinite"]
        if role == "policy":
            assert policy.weights_digest() == before
    assert step.state()["skipped_in_a_row"][role] == 2
    with pytest.raises(NonFiniteGradientError, match=f"the {role}'s gradients were not finite"):
        step.train(4, Group.split(_samples(4), [0.0, 1.0] * 4, 4))
