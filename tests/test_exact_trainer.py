"""Exact mode end to end in one process: the transformers engine samples with
`[rollout] exact = true`'s numerics, and ferrule-trainer's Actor, given the same numerics as the
launcher gives it (`prepare_model`), scores the samples with the very same logprobs: its old
logprobs equal the engine's bit for bit and an on-policy step measures vllm_kl = 0, where the
default numerics measure more. The step still trains: its loss and gradient norm match the
default Actor's to rounding (the exact attention's backward is sdpa's)."""

import pytest
import torch

from ferrule_rollout import SamplingSettings
from ferrule_rollout.exact import ExactNumerics
from ferrule_rollout.hf_engine import TransformersEngine
from ferrule_testkit import tiny_model
from ferrule_trainer import rl
from ferrule_trainer.actor import Actor
from ferrule_trainer.settings import EpochPlan, ForwardPlan, PolicyLoss

MAX_MODEL_LEN = 128
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def rollout():
    path = tiny_model("qwen2")
    engine = TransformersEngine(
        path, dtype="float32", exact=True, max_model_len=MAX_MODEL_LEN, max_batch_size=5
    )
    try:
        settings = SamplingSettings(n=4, max_tokens=40, temperature=TEMPERATURE, seed=2)
        samples = engine.generate(["2 + 2 =", "the quick brown fox", "a b c d e f g"], settings)
    finally:
        engine.close()
    batch = rl.build_batch(samples, pad_id=0)
    batch = batch.replace(
        advantages=torch.randn(batch.response_mask.shape, generator=torch.Generator())
    )
    return path, batch, rl.rollout_logprobs(samples, batch)


def actor(path, exact: bool) -> Actor:
    prepare = ExactNumerics(MAX_MODEL_LEN).apply if exact else None
    return Actor(
        path,
        dtype="float32",
        zero_stage=0,
        seed=0,
        temperature=TEMPERATURE,
        learning_rate=1e-2,
        prepare_model=prepare,
    )


def test_the_trainer_scores_exact_samples_as_the_engine_did(rollout):
    path, batch, engine_logprobs = rollout
    exact, default = actor(path, exact=True), actor(path, exact=False)
    mask = batch.response_mask.bool()

    for micro_batch_size in (1, 5, None):
        old = exact.logprobs(batch, ForwardPlan(micro_batch_size))
        assert torch.equal(old[mask], engine_logprobs[mask])
    assert not torch.equal(default.logprobs(batch)[mask], engine_logprobs[mask])

    plan = EpochPlan(micro_batch_size=4)
    step = batch.replace(rollout_logprobs=engine_logprobs)
    exact_metrics = exact.train_epochs(step, plan, PolicyLoss())
    default_metrics = default.train_epochs(step, plan, PolicyLoss())
    assert exact_metrics["vllm_kl"] == 0.0
    assert 0 < default_metrics["vllm_kl"] < 1e-9
    assert exact_metrics["loss"] == pytest.approx(default_metrics["loss"], rel=1e-4, abs=1e-6)
    # gradients as the default's (Adam would amplify rounding in near-zero ones: compare norms)
    assert exact_metrics["grad_norm"] == pytest.approx(default_metrics["grad_norm"], rel=1e-5)
