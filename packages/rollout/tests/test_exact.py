"""Exact mode: the engine's sampled logprobs equal, bit for bit, a teacher-forced forward of the
same weights in the trainer's layout (left-padded prompts, right-padded responses, micro-batches
of other sequences), however the engine batched them; the attention's backward is sdpa's
gradient; bad settings are refused.

The trainer's own functions and Actor are checked the same way in tests/test_exact_trainer.py;
here the teacher-forced side is a plain transformers model with ExactNumerics applied.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferrule_rollout import RolloutError, SamplingSettings
from ferrule_rollout.config import EngineConfig
from ferrule_rollout.exact import ExactNumerics
from ferrule_rollout.hf_engine import TransformersEngine
from ferrule_testkit import teacher_forced_logprobs, tiny_model

PROMPTS = ["2 + 2 =", "the quick brown fox jumps over", "a", [5, 6, 7, 8, 9] * 7]
MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def path():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def engine(path):
    engine = TransformersEngine(path, dtype="float32", exact=True, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trainer_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ExactNumerics(MAX_MODEL_LEN).apply(model)


# one row and three rows at a time (continuous batching; ~50 s together) in the e2e tier
@pytest.mark.parametrize(
    "max_batch_size",
    [pytest.param(1, marks=pytest.mark.e2e), pytest.param(3, marks=pytest.mark.e2e), 256],
)
def test_logprobs_equal_the_trainers_bit_for_bit(engine, trainer_model, max_batch_size):
    """Rows joining and leaving mid-call (1, 3), all at once (256), EOS ends (other lengths)."""
    engine.max_batch_size = max_batch_size
    settings = SamplingSettings(n=3, max_tokens=48, temperature=0.7, seed=11)
    samples = engine.generate(PROMPTS, settings)
    for micro_batch in (1, 5):
        theirs = teacher_forced_logprobs(trainer_model, samples, micro_batch, temperature=0.7)
        for sample, expected in zip(samples, theirs, strict=True):
            assert torch.equal(torch.tensor(sample.logprobs), expected), (sample, micro_batch)


def test_default_engine_is_not_bit_exact(path, trainer_model):
    """What exact mode buys: the default engine differs from the same teacher-forced forward
    (by rounding only), so the test above can fail."""
    engine = TransformersEngine(path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    try:
        samples = engine.generate(PROMPTS, SamplingSettings(n=2, max_tokens=32, seed=3))
    finally:
        engine.close()
    theirs = teacher_forced_logprobs(trainer_model, samples, 4)
    ours = [torch.tensor(s.logprobs) for s in samples]
    differences = torch.cat([a - b for a, b in zip(ours, theirs, strict=True)]).abs()
    assert 0 < differences.max() < 1e-4


def test_a_rows_logits_do_not_depend_on_its_batch(trainer_model):
    """The trainer's side alone: the same sequence, alone, among others, under left padding and
    cut short, gives the same logits bit for bit."""
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(3, 400, (37,), generator=generator).tolist()
    others = [torch.randint(3, 400, (n,), generator=generator).tolist() for n in (5, 60, 12)]

    def logits(rows, left):
        width = max(len(s) + pad for s, pad in zip(rows, left, strict=True))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (s, pad) in enumerate(zip(rows, left, strict=True)):
            ids[r, pad : pad + len(s)], mask[r, pad : pad + len(s)] = torch.tensor(s), 1
        with torch.no_grad():
            out = trainer_model(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
            ).logits
        return [
            out[r, pad : pad + len(s)] for r, (s, pad) in enumerate(zip(rows, left, strict=True))
        ]

    alone = logits([sequence], [0])[0]
    assert torch.equal(alone, logits([sequence, *others], [3, 0, 1, 7])[0])
    assert torch.equal(alone, logits([*others, sequence], [0, 0, 0, 30])[-1])
    assert torch.equal(alone[:20], logits([sequence[:20]], [0])[0])


def test_attention_gradients_are_sdpas(path):
    """The exact forward's backward runs sdpa on the same inputs: the gradients of a loss match
    the plain model's to rounding."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 400, (3, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[2, 20:] = 0  # right padding
    grads = []
    for exact in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if exact:
            ExactNumerics(64).apply(model)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
        (logits.float().log_softmax(-1)[..., 7] * mask).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, plain in grads[0].items():
        torch.testing.assert_close(grads[1][name], plain, rtol=1e-4, atol=1e-5, msg=name)


def test_bad_settings_are_refused(path):
    with pytest.raises(ValueError, match="key_slots"):
        ExactNumerics(0)
    with pytest.raises(RolloutError, match="exclude each other"):
        TransformersEngine(path, dtype="float32", exact=True, compile_decode=True)
    with pytest.raises(ValueError, match='exact needs backend = "transformers"'):
        EngineConfig(backend="vllm", exact=True)
    with pytest.raises(ValueError, match=r"needs top_p = 1, got 0\.9"):
        EngineConfig(backend="transformers", top_p=0.9, exact=True)
    with pytest.raises(ValueError, match="exclude each other"):
        EngineConfig(backend="transformers", exact=True, compile_decode=True)
    options = EngineConfig(backend="transformers", exact=True).engine_options()
    assert options["exact"] is True and options["compile_decode"] is False
