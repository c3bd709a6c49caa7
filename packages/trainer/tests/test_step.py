"""The RL step in process, no Ray: every estimator x rollout correction, with and without LoRA,
and the two recipes, on real `Actor` / `Critic` ranks (DeepSpeed, the tiny kit model, CPU)
through `LocalRanks`. The rollout's log-probabilities are the policy's own, so the step's
measured engine-trainer KL is ~0 and any training is visible in the weights."""

from dataclasses import dataclass, field

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_trainer.config import (
    CriticConfig,
    IterativeDPOConfig,
    RejectionSamplingConfig,
    TrainerConfig,
)
from ferrule_trainer.groups import Group
from ferrule_trainer.ranks import LocalRanks
from ferrule_trainer.recipes import reaches
from ferrule_trainer.settings import ForwardPlan
from ferrule_trainer.step import RLStep

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
CORRECTIONS = [
    {},
    {"rollout_correction": "tis"},
    {"rollout_correction": "icepop"},
    {"sequence_mask": (0.5, 2.0)},
]
N = 4  # samples per prompt


@dataclass
class Sample:  # the fields of ferrule-rollout's Sample that a step reads
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    version: int = 0
    finish_reason: str = "stop"


def actor(**options):
    from ferrule_trainer.actor import Actor

    return Actor(tiny_model("qwen2"), zero_stage=0, dtype="float32", learning_rate=1e-3, **options)


@pytest.fixture(scope="module")
def policy():
    return actor()


@pytest.fixture(scope="module")
def lora_policy():
    return actor(lora_rank=4, lora_alpha=8)


@pytest.fixture(scope="module")
def reference():
    return actor(train=False)


@pytest.fixture(scope="module")
def critic():
    from ferrule_trainer.critic import Critic

    return Critic(tiny_model("qwen2"), zero_stage=0, dtype="float32", learning_rate=1e-3)


def rollout(model, groups: int = 2, version: int = 0, seed: int = 0) -> list[Sample]:
    """`groups` x N samples of random tokens, their log-probabilities the model's own."""
    from ferrule_trainer.rl import build_batch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(groups * N):
        prompt = torch.randint(5, 400, (3 + i % 3,), generator=g).tolist()
        response = torch.randint(5, 400, (2 + i % 4,), generator=g).tolist()
        samples.append(Sample(prompt, response, version=version))
    batch = build_batch(samples, 0)
    own = model.logprobs(batch, ForwardPlan(64))
    for row, sample in enumerate(samples):
        sample.logprobs = own[row, : len(sample.token_ids)].tolist()
    return samples


def scores(groups: int = 2) -> list[float]:
    return [float((i * 7) % 5) / 4 for i in range(groups * N)]


def grouped(samples, scores, n: int = N) -> list[Group]:
    return Group.split(samples, scores, n)


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.engine.module.parameters()])


def step(trainer: TrainerConfig, policy, reference=None, critic=None, **options) -> RLStep:
    return RLStep(
        trainer,
        CriticConfig() if critic is not None else None,
        group_size=N,
        pad_id=0,
        policy=LocalRanks(policy),
        reference=LocalRanks(reference) if reference is not None else None,
        critic_ranks=LocalRanks(critic) if critic is not None else None,
        **options,
    )


@pytest.mark.parametrize("correction", CORRECTIONS, ids=lambda c: "-".join(map(str, c)) or "none")
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_and_correction_trains_the_policy(policy, reference, estimator, correction):
    trainer = TrainerConfig(estimator=estimator, kl_coef=0.01, **correction)
    samples = rollout(policy)
    before = weights(policy)
    metrics = step(trainer, policy, reference).train(1, grouped(samples, scores()))
    assert not torch.equal(before, weights(policy))  # the policy took an optimizer step
    assert metrics["vllm_kl"] == pytest.approx(0.0, abs=1e-5)  # its own log-probabilities
    assert "kl" in metrics and metrics["kl_coef"] == 0.01  # k1's mean: either sign
    assert metrics["dropped_stale_groups"] == 0 and metrics["staleness"] == 0
    assert metrics["time/forward"] > 0  # the reference's pass (and old logprobs' where needed)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    if correction.get("rollout_correction") == "tis":
        assert metrics["rollout_correction/truncated"] == 0.0  # every ratio is 1
    if "sequence_mask" in correction:
        assert metrics["rollout_correction/masked_sequences"] == 0.0


def test_gae_trains_the_policy_and_the_critic(policy, reference, critic):
    trainer = TrainerConfig(estimator="gae", kl_coef=0.05, kl_in="reward")
    samples = rollout(policy)
    before = weights(critic)
    metrics = step(trainer, policy, reference, critic).train(1, grouped(samples, scores()))
    assert not torch.equal(before, weights(critic))
    assert metrics["critic/loss"] > 0 and "train/loss" in metrics


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
@pytest.mark.parametrize("correction", ["none", "icepop"])
def test_a_lora_policy_trains_only_its_adapters(lora_policy, estimator, correction):
    trainer = TrainerConfig(estimator=estimator, rollout_correction=correction, lora_rank=4)
    frozen = {
        n: p.detach().clone() for n, p in lora_policy.module.named_parameters() if "lora" not in n
    }
    adapters = {
        n: p.detach().clone() for n, p in lora_policy.module.named_parameters() if "lora" in n
    }
    assert adapters
    step(trainer, lora_policy).train(1, grouped(rollout(lora_policy), scores()))
    now = dict(lora_policy.module.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    assert any(not torch.equal(now[n], p) for n, p in adapters.items())


def test_stale_groups_are_dropped_and_fresh_ones_trained(policy):
    samples = rollout(policy, groups=3, version=4)
    samples[N].version = 1  # one sample of the second group: 3 versions behind step 6's
    the_step = step(TrainerConfig(), policy, max_staleness=1)
    metrics = the_step.train(6, grouped(samples, scores(3)))
    assert metrics["dropped_stale_groups"] == 1
    assert metrics["staleness"] == 1.0  # the kept ones: version 4 trained at step 6
    assert step(TrainerConfig(), policy).train(9, grouped(samples, scores(3))) == {
        "dropped_stale_groups": 3
    }


def test_all_equal_groups_leave_the_policy_alone():
    fresh = actor()  # no optimizer moments yet: a zero gradient is a zero update
    before = weights(fresh)
    step(TrainerConfig(estimator="grpo"), fresh).train(1, grouped(rollout(fresh), [0.7] * 2 * N))
    assert torch.equal(before, weights(fresh))  # zero advantages: zero gradient


def test_the_kl_controller_and_reward_moments_are_state_that_round_trips(policy, reference):
    trainer = TrainerConfig(kl_coef=0.1, kl_target=1e-6, kl_horizon=10, reward_norm="running")
    the_step = step(trainer, policy, reference)
    policy_samples = rollout(policy)
    with torch.no_grad():  # move the policy off the reference: a KL above the target
        for p in policy.module.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    metrics = the_step.train(1, grouped(policy_samples, scores()))
    assert metrics["kl"] > 1e-6 and metrics["kl_coef"] == 0.1
    assert the_step.recipe.kl_coef > 0.1  # raised towards the target
    saved = the_step.state()
    assert saved["reward_moments"][0] == 2 * N  # every score counted
    again = step(trainer, policy, reference)
    again.restore(saved)
    assert again.state() == saved


def test_shaping_truncated_and_overlong_responses():
    samples = [Sample([1], [2] * 8, finish_reason="length"), Sample([1], [2] * 7), Sample([1], [2])]
    trainer = TrainerConfig(truncated_score=-1.0, overlong_buffer=4, overlong_penalty=1.0)
    the_step = RLStep(trainer, None, group_size=3, pad_id=0, policy=None)
    shaped, penalties = the_step.shape(samples, [1.0, 1.0, 1.0], max_tokens=8)
    assert shaped[0] == -1.0  # truncated: the fixed score, no penalty on top
    assert penalties[1] == pytest.approx(-0.75) and shaped[1] == pytest.approx(0.25)
    assert shaped[2] == 1.0 and penalties[2] == 0.0


def test_keep_is_every_group_or_dapos_filter_on_inexact_floats():
    the_step = RLStep(TrainerConfig(), None, group_size=2, pad_id=0, policy=None)
    samples = [Sample([1], [2]) for _ in range(6)]
    groups = grouped(samples, [0.1, 0.2, 0.1, 0.1, 1.0, 1.0], n=2)
    assert the_step.keep(groups[:2]) == groups[:2]
    dapo = RLStep(
        TrainerConfig(), None, group_size=2, pad_id=0, policy=None, keep_group_mean=(0.1, 1.0)
    )
    # 0.1 + 0.2 is not 0.3 in floats; an all-0.1 group's mean is exactly the bound: dropped
    assert dapo.keep(groups) == groups[:1]
    with pytest.raises(ValueError, match="group 0 has 3 samples; the step's groups have 2"):
        the_step.keep(grouped(samples[:3], [0.0] * 3, n=3))


def test_rejection_sampling_trains_on_the_best_of_each_group(policy):
    chosen = []
    settings = RejectionSamplingConfig(chosen_min_reward=0.5)
    the_step = step(TrainerConfig(), policy, recipe=settings)
    rewards = [0.0, 1.0, 0.25, 0.5, 0.0, 0.1, 0.2, 0.3]  # the second group never reaches 0.5
    before = weights(policy)
    metrics = the_step.train(1, grouped(rollout(policy), rewards), on_chosen=chosen.extend)
    assert [i for _, i in chosen] == [1] and chosen[0][0].scores == (0.0, 1.0, 0.25, 0.5)
    assert metrics["train/chosen"] == 1 and metrics["train/chosen_reward"] == 1.0
    assert not torch.equal(before, weights(policy))


def test_iterative_dpo_pairs_best_against_worst(policy, reference):
    the_step = step(TrainerConfig(), policy, reference, recipe=IterativeDPOConfig())
    rewards = [0.0, 1.0, 0.25, 0.5] + [0.3] * N  # an all-equal group gives no pair
    metrics = the_step.train(1, grouped(rollout(policy), rewards))
    assert metrics["train/pairs"] == 1 and "train/loss" in metrics
    with pytest.raises(ValueError, match="needs a reference"):
        step(TrainerConfig(), policy, recipe=IterativeDPOConfig())


def test_bad_arguments_name_themselves(policy):
    with pytest.raises(ValueError, match="unknown recipe settings 'ppo2'"):
        step(TrainerConfig(), policy, recipe="ppo2")
    with pytest.raises(ValueError, match="a critic needs both"):
        RLStep(TrainerConfig(), CriticConfig(), group_size=N, pad_id=0, policy=LocalRanks(policy))


def test_every_estimator_the_config_names_is_registered_and_an_unknown_one_is_named():
    from ferrule_trainer import config, rl

    assert set(rl.ESTIMATORS) == set(config.ESTIMATORS)
    batch = rl.build_batch([Sample([1], [2, 3]) for _ in range(2)], pad_id=0)
    with pytest.raises(ValueError, match="unknown estimator 'ppo2'; estimators are"):
        rl.estimate("ppo2", torch.zeros(2), batch, group_size=2)


def test_a_recipes_state_and_the_skip_counters_round_trip(policy, reference):
    """The state a resume restores: the PPO family's KL coefficient and reward moments (its
    own), the skip counters (the step's); a recipe without state keeps the counters."""
    dpo = step(TrainerConfig(), policy, reference, recipe=IterativeDPOConfig())
    dpo.skips["policy"].in_a_row = 2
    assert dpo.state() == {"skipped_in_a_row": {"policy": 2, "critic": 0}}
    again = step(TrainerConfig(), policy, reference, recipe=IterativeDPOConfig())
    again.restore(dpo.state())
    assert again.skips["policy"].in_a_row == 2


def test_reaches_is_within_a_rounding_error():
    assert reaches(0.7 - 0.4, 0.3) and reaches(1.0, 0.5) and not reaches(0.29, 0.3)


def test_gspo_brings_its_aggregation_and_token_ratios_keep_the_default():
    assert TrainerConfig(ratio_level="sequence").agg_mode == "seq-mean-token-mean"
    assert TrainerConfig().agg_mode == "token-mean"
    gspo = TrainerConfig(ratio_level="sequence", clip_low=3e-4).policy_loss()
    assert gspo.agg_mode == "seq-mean-token-mean" and gspo.ratio_level == "sequence"
