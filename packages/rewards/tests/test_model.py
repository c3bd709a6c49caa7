"""The Hugging Face reward-model backend, on a tiny random sequence-classification model."""

import math
from functools import partial

import pytest

from ferrule_rewards.client import RewardClient
from ferrule_rewards.records import Status
from ferrule_rewards.server import BackgroundServer

TEXTS = [
    "Question: what is 2 + 2?\nAnswer: 4",
    "hi",
    "A much longer response that goes on for a while, so that the batch needs padding. " * 3,
    "Question: what is 2 + 2?\nAnswer: 5",
]


def build(folder, num_labels: int = 1):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from ferrule_testkit import tiny_model

    source = tiny_model("qwen2")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(source, num_labels=num_labels)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("reward-model"))


def test_rewards_do_not_depend_on_batching(reward_model):
    from ferrule_rewards.model import ModelScorer

    one_by_one = ModelScorer(reward_model, device="cpu", batch_size=1).score_texts(TEXTS)
    batched = ModelScorer(reward_model, device="cpu", batch_size=4).score_texts(TEXTS)
    assert not one_by_one.errors and not batched.errors
    for alone, padded in zip(one_by_one.rewards, batched.rewards, strict=True):
        assert math.isfinite(alone) and alone == pytest.approx(padded, abs=1e-4)
    assert len(set(batched.rewards)) == len(TEXTS)  # a real function of the text


def test_forwards_keep_to_the_token_budget_and_the_rewards_do_not_change(reward_model):
    """Each forward holds at most batch_tokens padded tokens (samples x the longest), a sample
    over the budget goes alone, and the rewards are those of the unbudgeted scorer."""
    from ferrule_rewards.model import ModelScorer

    texts = ["a b " * n for n in (1, 2, 3, 4, 6, 8, 40)]
    plain = ModelScorer(reward_model, device="cpu", batch_size=8, batch_tokens=10**6)
    budgeted = ModelScorer(reward_model, device="cpu", batch_size=8, batch_tokens=48)
    lengths = [len(t) for t in budgeted.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    assert max(lengths) > 48 > 2 * sorted(lengths)[-2]  # one over the budget, pairs fit
    shapes = []
    forward = budgeted._forward
    budgeted._forward = lambda ids: shapes.append((len(ids), max(map(len, ids)))) or forward(ids)
    scores = budgeted.score_texts(texts)
    assert not scores.errors
    assert scores.rewards == pytest.approx(plain.score_texts(texts).rewards, abs=1e-4)
    assert sum(rows for rows, _ in shapes) == len(texts) and len(shapes) > 2
    assert (1, max(lengths)) in shapes  # the long one alone
    assert all(rows * longest <= 48 for rows, longest in shapes if longest <= 48)
    with pytest.raises(ValueError, match="batch_tokens must be >= 1, got 32 and 0"):
        ModelScorer(reward_model, device="cpu", batch_tokens=0)


def test_a_response_ending_in_the_pad_token_is_read_at_its_end(tmp_path):
    """Padding with the end-of-sequence token must not move where a sequence is read: the score
    of a text that ends with it is the same alone and padded in a batch, and is read at that
    token (dropping it changes the score)."""
    from transformers import AutoTokenizer

    from ferrule_rewards.model import ModelScorer

    folder = build(tmp_path / "eos-padded")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    eos = tokenizer.eos_token
    texts = ["Answer: 4" + eos, "a much longer text that makes the first one padded" + eos]
    alone = ModelScorer(folder, device="cpu", batch_size=1).score_texts(texts).rewards
    batched = ModelScorer(folder, device="cpu", batch_size=2).score_texts(texts).rewards
    assert batched == pytest.approx(alone, abs=1e-5)
    without_eos = ModelScorer(folder, device="cpu").score_texts(["Answer: 4"]).rewards[0]
    assert without_eos != pytest.approx(alone[0], abs=1e-4)


def test_samples_the_model_cannot_take_get_a_status(reward_model):
    from ferrule_rewards.model import ModelScorer

    scorer = ModelScorer(reward_model, device="cpu", max_length=16)
    scores = scorer.score([("", ""), ("short", " one"), ("long " * 40, "x")])
    assert scores.errors[0] == (Status.INVALID_SAMPLE, "prompt + response is empty")
    assert scores.errors[2][0] == Status.INVALID_SAMPLE
    assert "the reward model takes at most 16" in scores.errors[2][1]
    assert 1 not in scores.errors and math.isfinite(scores.rewards[1])


def test_scored_through_the_server(reward_model):
    from ferrule_rewards.model import ModelScorer

    expected = ModelScorer(reward_model, device="cpu").score_texts(["Q: 1+1? A: 2", "Q: ? A:"])
    with (
        BackgroundServer(partial(ModelScorer, reward_model, device="cpu")) as server,
        RewardClient(server.address) as client,
    ):
        results = client.score(
            [{"prompt": "Q: 1+1?", "response": " A: 2"}, {"prompt": "Q: ?", "response": " A:"}]
        )
    assert [r.reward for r in results] == pytest.approx(expected.rewards, abs=1e-5)


def test_only_single_output_models(tmp_path):
    from ferrule_rewards.model import ModelScorer

    with pytest.raises(ValueError, match="has 2 labels; a reward model has one output"):
        ModelScorer(build(tmp_path, num_labels=2), device="cpu")


@pytest.mark.e2e  # ~8 s: a server process of its own
def test_served_from_the_command_line(spawn, reward_model):
    server = spawn("--model", str(reward_model), "--device", "cpu", timeout=180)
    with RewardClient(server.address) as client:
        result = client.score([{"prompt": "Q: 1+1?", "response": " A: 2"}])[0]
    assert result.ok and math.isfinite(result.reward)
    assert server.stop() == 0


@pytest.mark.gpu
def test_gpu_matches_cpu(reward_model):
    from ferrule_rewards.model import ModelScorer

    cpu = ModelScorer(reward_model, device="cpu").score_texts(TEXTS)
    gpu = ModelScorer(reward_model, device="cuda", dtype="float32").score_texts(TEXTS)
    assert gpu.rewards == pytest.approx(cpu.rewards, abs=1e-3)
    half = ModelScorer(reward_model, device="cuda").score_texts(TEXTS)  # bf16 by default
    assert half.rewards == pytest.approx(cpu.rewards, abs=0.1)


def test_normalize_uses_the_moments_saved_beside_the_model(tmp_path):
    import json
    import shutil

    from ferrule_rewards.model import STATS_FILE, ModelScorer

    folder = build(tmp_path / "rm")
    raw = ModelScorer(folder, device="cpu").score_texts(TEXTS).rewards
    with pytest.raises(ValueError, match=f"--normalize needs {STATS_FILE} beside it"):
        ModelScorer(folder, device="cpu", normalize=True)
    (folder / STATS_FILE).write_text(json.dumps({"mean": 0.1, "std": 0.3}))
    normalized = ModelScorer(folder, device="cpu", normalize=True).score_texts(TEXTS).rewards
    assert normalized == pytest.approx([(r - 0.1) / 0.3 for r in raw], abs=1e-5)
    for bad, message in [({"mean": 0.0, "std": 0.0}, "a std > 0"), ({"mean": 1}, "'std'")]:
        (folder / STATS_FILE).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            ModelScorer(folder, device="cpu", normalize=True)
    shutil.rmtree(folder)
