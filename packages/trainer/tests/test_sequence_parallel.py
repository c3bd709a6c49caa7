"""Sequence parallelism (sequence_parallel.py) on 2 and 4 CPU processes (gloo) against one
process: log-probabilities, entropies and every gradient of the plain model, padded, packed and
without padding;
an Actor's log-probabilities, PPO step (KL and entropy on) and weights after it, and a Critic's
values and value-loss step, under ZeRO-2 and ZeRO-3 (the reference run: one process, ZeRO-2)."""

import sys
from pathlib import Path

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_testkit.gloo import run_ranks

pytestmark = pytest.mark.e2e  # DeepSpeed groups of 2-4 processes

WORKER = Path(__file__).with_name("sequence_parallel_worker.py")
sys.path.insert(0, str(WORKER.parent))
from sequence_parallel_worker import layouts, weights  # noqa: E402


def run(model, out: Path, world: int, zero_stage: int = 2, composed: bool = False) -> dict:
    out.mkdir()
    variant = "composed" if composed else "plain"
    args = [sys.executable, str(WORKER), str(model), str(out), str(world), str(zero_stage), variant]
    run_ranks(args, world)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


@pytest.fixture(scope="module")
def model():
    # 4 query heads over 2 key/value heads: every head count splits over 4 ranks after the
    # key/value heads are repeated
    return tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def one_rank(model, tmp_path_factory):
    return run(model, tmp_path_factory.mktemp("one") / "run", world=1)


def plain_reference(model_path) -> dict:
    """What one process computes for plain_model_pass's sums."""
    from transformers import AutoModelForCausalLM

    from ferrule_trainer.sequences import response_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    out = {}
    for layout, (data, packed) in layouts().items():
        model.zero_grad()
        logprobs, entropy = response_logprobs(model, data, 0.7, packed=packed, entropy=True)
        w = weights(*logprobs.shape)
        ((logprobs * w).sum() + (entropy * w.flip(0)).sum()).backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        out[layout] = dict(logprobs=logprobs.detach(), entropy=entropy.detach(), grads=grads)
    return out


@pytest.mark.parametrize("world, zero_stage", [(2, 2), (4, 2), (2, 3)])
def test_sequence_parallel_ranks_equal_one_rank(model, one_rank, world, zero_stage, tmp_path):
    result = run(model, tmp_path / "run", world, zero_stage)
    expected = plain_reference(model)
    for layout in ("padded", "packed", "unpadded"):
        got, want = result["first"][layout], expected[layout]
        torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["entropy"], want["entropy"], rtol=1e-5, atol=1e-5)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
        assert (want["logprobs"] != 0).sum() > 20  # real tokens were compared
    assert result["first"]["widest_head_call"] == 3  # the head ran on chunks of the shard

    check_actor(result["actor"], one_rank["actor"], start_weights(model))
    check_critic(result["critic"], one_rank["critic"])


def test_sequence_parallel_composes_with_checkpointing_lora_packing_and_token_budgets(
    model, tmp_path
):
    """The Actor with gradient checkpointing (the all-to-alls run again in backward), LoRA, and
    its passes packed into micro-batches of at most 48 tokens, on 2 ranks against 1."""
    one = run(model, tmp_path / "one", 1, composed=True)["actor"]
    two = run(model, tmp_path / "two", 2, composed=True)["actor"]
    check_actor(two, one, start_weights(model))


def check_actor(shared: dict, one: dict, start: dict) -> None:
    """An Actor's log-probabilities, step metrics and weights after the step."""
    torch.testing.assert_close(shared["logprobs"], one["logprobs"], rtol=1e-5, atol=1e-5)
    for key in ("loss", "tokens", "grad_norm", "clip_fraction", "approx_kl"):
        assert shared["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4), key
    assert shared["weights"].keys() == one["weights"].keys()
    moved = 0
    for name, weight in one["weights"].items():
        update_one, update_shared = weight - start[name], shared["weights"][name] - start[name]
        moved += bool(update_one.abs().max() > 1e-3)
        # Adam's first step is about lr * sign(g): where |g| is near its eps, float rounding
        # moves single elements by a few % of lr (as test_actor_distributed's ZeRO-3 ranks)
        torch.testing.assert_close(update_shared, update_one, rtol=0, atol=3e-4, msg=name)
        assert (update_shared - update_one).abs().mean() < 1e-6, name
    assert moved >= 4  # the step moved weights (with LoRA: the adapted projections, merged)


def check_critic(shared: dict, one: dict) -> None:
    """The critic's values (0 at padding under sequence parallelism: compared where real), its
    value-loss step and, but under ZeRO-3, its weights after the step."""
    real = batch_mask()
    torch.testing.assert_close(shared["values"][real], one["values"][real], rtol=1e-5, atol=1e-5)
    for key in ("loss", "grad_norm", "value_clip_fraction"):
        assert shared["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4), key
    if shared["weights"] is None:
        return
    for name, weight in one["weights"].items():
        torch.testing.assert_close(shared["weights"][name], weight, rtol=0, atol=3e-4, msg=name)
        assert (shared["weights"][name] - weight).abs().mean() < 1e-6, name


def batch_mask() -> torch.Tensor:
    data, _ = layouts()["padded"]
    return data.attention_mask[:, -data.response_len :].bool()


def start_weights(model_path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {name: t.detach() for name, t in loaded.state_dict().items()}


def test_a_head_count_that_does_not_divide_is_refused():
    from transformers import AutoConfig

    from ferrule_trainer.sequence_parallel import check_model

    config = AutoConfig.from_pretrained(tiny_model("qwen2"))  # 2 heads
    with pytest.raises(ValueError, match="2 attention heads must divide by it"):
        check_model(config, 4)
    config.final_logit_softcapping = 30.0  # the head runs alone on each rank: no softcap
    with pytest.raises(ValueError, match="logits final_logit_softcapping changes"):
        check_model(config, 1)
