"""The RL step's data and math (rl.py): the batch layout from samples, every estimator, PPO epochs."""

import math
from types import SimpleNamespace

import pytest
import torch

from ferrule_trainer import advantages, rl
from ferrule_trainer.batch import Batch
from ferrule_trainer.config import ESTIMATORS
from ferrule_trainer.reward_shaping import token_rewards
from ferrule_trainer.rl import (
    build_batch,
    critic_batch,
    estimate,
    mean_kl,
    policy_batch,
    ppo_epochs,
    trim_groups,
)
from ferrule_trainer.settings import Correction, EpochPlan


def sample(prompt, response):
    return SimpleNamespace(prompt_token_ids=prompt, token_ids=response)


def _numbered(rows):
    """A batch whose row i starts with token i."""
    ids = torch.stack([torch.arange(rows), torch.zeros(rows, dtype=torch.long)], dim=1)
    return Batch(ids, torch.ones(rows, 2), torch.ones(rows, 1))


def test_build_batch_left_pads_prompts_and_right_pads_responses():
    batch = build_batch([sample([5, 6], [7]), sample([4], [8, 9, 0])], pad_id=1)
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 1], [1, 4, 8, 9, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert [mb.rows for mb in batch.split(1)] == [1, 1]


def test_a_multi_turn_samples_mask_keeps_environment_tokens_out_of_every_loss():
    # tokens 8 and 9 were inserted by an environment between two model turns
    turns = SimpleNamespace(prompt_token_ids=[4], token_ids=[7, 8, 9, 6], mask=[1, 0, 0, 1])
    batch = build_batch([turns, sample([5, 6], [7])], pad_id=1)
    assert batch.input_ids.tolist() == [[1, 4, 7, 8, 9, 6], [5, 6, 7, 1, 1, 1]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 0, 0, 1], [1, 0, 0, 0]]
    # the score sits on the last model token; the environment's tokens get no advantage
    for estimator in ("gae", "reinforce_plus_plus", "grpo"):
        advantages, _ = estimate(
            estimator,
            torch.tensor([1.0, 0.0]),
            batch,
            group_size=2,
            old_logprobs=torch.zeros(2, 4),
            ref_logprobs=torch.zeros(2, 4),
            values=torch.zeros(2, 4),
            kl_coef=0.0,
        )
        assert advantages[0, 1:3].tolist() == [0.0, 0.0], estimator
        assert advantages[0, 0] != 0 and advantages[0, 3] != 0, estimator
    bad = SimpleNamespace(prompt_token_ids=[4], token_ids=[7, 8], mask=[1])
    with pytest.raises(ValueError, match="sample 0: mask has 1 entries for 2 tokens"):
        build_batch([bad], pad_id=1)


def test_turn_rewards_are_credited_at_their_own_turn():
    # model, model, environment, model: the first turn earned 0.5, the episode 1.5 in all
    turns = SimpleNamespace(
        prompt_token_ids=[4], token_ids=[7, 8, 9, 6], mask=[1, 1, 0, 1], turn_rewards=[(1, 0.5)]
    )
    single = SimpleNamespace(prompt_token_ids=[5], token_ids=[7, 3], mask=None)
    batch = build_batch([turns, single], pad_id=1)
    earlier = rl.turn_rewards([turns, single], batch)
    assert earlier.tolist() == [[0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert rl.turn_rewards([single, single], batch) is None  # single-turn batches: nothing
    scores = torch.tensor([1.5, 1.0])
    rewards = token_rewards(scores, batch.response_mask, turn_rewards=earlier)
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]  # rows sum to scores
    # REINFORCE++ (gamma 1): the tokens after the first turn do not share its reward
    mask = batch.response_mask
    returns = advantages.discounted_returns(rewards, mask)
    assert returns[0].tolist() == [1.5, 1.5, 0.0, 1.0]
    with_turns, _ = estimate(
        "reinforce_plus_plus", scores, batch, group_size=2, turn_rewards=earlier
    )
    without, _ = estimate("reinforce_plus_plus", scores, batch, group_size=2)
    assert with_turns[0, 3] < without[0, 3]  # the last turn is credited its own 1.0 only
    grpo, _ = estimate("grpo", scores, batch, group_size=2, turn_rewards=earlier)
    assert torch.equal(grpo, estimate("grpo", scores, batch, group_size=2)[0])
    bad = SimpleNamespace(prompt_token_ids=[4], token_ids=[7], mask=None, turn_rewards=[(3, 1.0)])
    with pytest.raises(ValueError, match="sample 0: a turn reward at token 3; it has 1 tokens"):
        rl.turn_rewards([bad], build_batch([bad], pad_id=1))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_gives_advantages_of_the_right_sign(estimator):
    mask = torch.ones(4, 3, dtype=torch.long)
    batch = Batch(torch.zeros(4, 5, dtype=torch.long), torch.ones(4, 5), mask)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    logprobs = torch.full((4, 3), -1.0)
    advantages, returns = estimate(
        estimator,
        scores,
        batch,
        group_size=2,
        old_logprobs=logprobs,
        ref_logprobs=logprobs - 0.1,
        values=torch.zeros(4, 3),
        kl_coef=0.01,
        kl_in="reward" if estimator in ("gae", "reinforce_plus_plus") else "loss",
    )
    assert advantages.shape == (4, 3)
    assert (advantages[0] > 0).all() and (advantages[1] < 0).all()
    assert (returns is not None) == (estimator == "gae")


def test_trim_groups_keeps_a_multiple_of_ranks_times_mini_batches():
    assert trim_groups([0, 1, 2, 3, 5], group_size=2, multiple=4) == [0, 1, 2, 3]
    assert trim_groups([0, 1, 2], group_size=4, multiple=2) == [0, 1, 2]
    assert trim_groups([4], group_size=2, multiple=4) == []


def test_ppo_epochs_steps_over_mini_batches_of_micro_batches_and_averages():
    batch = _numbered(8)
    seen = []

    def train_step(micro_batches, packed):
        seen.append([mb.input_ids[:, 0].tolist() for mb in micro_batches])
        return {"loss": len(seen), "packed": packed}

    metrics = ppo_epochs(train_step, batch, EpochPlan(2, 2, micro_batch_size=3))
    assert seen == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]] * 2  # 2 epochs x 2 optimizer steps
    assert metrics == {"loss": (1 + 2 + 3 + 4) / 4, "packed": 0.0}
    seen.clear()  # without a micro-batch size: one micro-batch per mini-batch
    ppo_epochs(train_step, batch, EpochPlan(mini_batches=2, pack_sequences=True))
    assert seen == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_policy_and_critic_batches_carry_what_their_train_steps_read():
    batch = build_batch([sample([5], [7, 8])], pad_id=0)
    old, adv = torch.zeros(1, 2), torch.ones(1, 2)
    policy = policy_batch(batch, old, adv, old, kl_coef_in_loss=0.0)
    assert policy.ref_logprobs is None and policy.advantages is adv and policy.old_logprobs is old
    assert policy_batch(batch, old, adv, old - 1, kl_coef_in_loss=0.1).ref_logprobs is not None
    critic = critic_batch(batch.replace(advantages=adv), old, adv)
    assert critic.old_values is old and critic.returns is adv
    assert critic.advantages is None and critic.input_ids is batch.input_ids


def test_mean_kl_is_k1_per_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    assert mean_kl(logprobs, ref, mask) == pytest.approx((0.5 - 1.0 + 0.5) / 3)


def test_rollout_correction_weights_and_the_vllm_kl_metric():
    samples = [
        SimpleNamespace(prompt_token_ids=[1], token_ids=[5, 6, 7], logprobs=[-1.0, -1.0, -1.0]),
        SimpleNamespace(prompt_token_ids=[1, 2], token_ids=[5], logprobs=[-2.0]),
    ]
    batch = rl.build_batch(samples, pad_id=0)
    engine = rl.rollout_logprobs(samples, batch)
    assert engine.tolist() == [[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]]
    trainer = torch.tensor([[-1.0, -1.0 + math.log(3.0), -1.0], [-2.0 + math.log(0.1), 0.0, 0.0]])
    weights, metrics = rl.rollout_correction(trainer, engine, batch, Correction("none"))
    assert weights is None
    x = [0.0, -math.log(3.0), 0.0, -math.log(0.1)]  # log engine - log trainer, valid tokens
    assert metrics["vllm_kl"] == pytest.approx(sum(math.expm1(-v) + v for v in x) / 4)
    weights, metrics = rl.rollout_correction(
        trainer, engine, batch, Correction("tis", tis_floor=0.2)
    )
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 1.0], [0.2, 0.0, 0.0]]))
    assert metrics["rollout_correction/truncated"] == pytest.approx(0.5)
    weights, metrics = rl.rollout_correction(trainer, engine, batch, Correction("icepop"))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 3.0, 1.0], [0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/masked"] == pytest.approx(0.25)
    # the second response's geometric-mean ratio is 0.1: the whole response goes
    weights, metrics = rl.rollout_correction(
        trainer, engine, batch, Correction("tis", sequence_mask=(0.5, 2.0))
    )
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 1.0], [0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/masked_sequences"] == 0.5
    weights, _ = rl.rollout_correction(trainer, engine, batch, Correction(sequence_mask=(0.5, 2.0)))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_keep_groups_drops_groups_whose_mean_is_on_or_outside_the_bounds():
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.1, 0.1, 0.7, 0.7])
    assert rl.keep_groups(scores, 2, 0.0, 1.0) == [2, 3, 4]  # all wrong, all right: gone
    # an all-equal group of a value that binary floats cannot hold: its mean is that value
    assert rl.keep_groups(scores, 2, 0.1, 1.0) == [2, 4]
    assert rl.keep_groups(torch.full((8,), 0.7), 8, 0.0, 0.7) == []


def test_ppo_epochs_keeps_units_of_rows_together():
    """unit=2 (preference pairs): mini- and micro-batches hold whole pairs, however the counts
    divide the rows."""
    batch = _numbered(10)  # 5 pairs
    seen = []

    def step(micro_batches, packed):
        seen.append([mb.input_ids[:, 0].tolist() for mb in micro_batches])
        return {"loss": 1.0}

    ppo_epochs(step, batch, EpochPlan(mini_batches=2, micro_batch_size=3), unit=2)
    assert seen == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]  # 4-row steps of 2-row parts
    assert all(len(part) % 2 == 0 for step_parts in seen for part in step_parts)
