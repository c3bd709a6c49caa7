"""The actor under ZeRO-3 on two processes (gloo) matches one process, and exports its weights."""

import json
import sys
from pathlib import Path

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_testkit.gloo import run_ranks
from ferrule_trainer.config import LORA_TARGETS

# DeepSpeed groups of 2-3 processes, 11-19 s each on 2 cores: the e2e tier.
pytestmark = pytest.mark.e2e

WORKER = Path(__file__).with_name("actor_step_worker.py")
EXPORT_WORKER = Path(__file__).with_name("export_worker.py")
UNEVEN_WORKER = Path(__file__).with_name("uneven_step_worker.py")


def _run(model, out: Path, world: int, zero_stage: int, lora_rank: int = 0) -> dict:
    out.mkdir()
    args = [sys.executable, str(WORKER), str(model), str(out), str(zero_stage), str(lora_rank)]
    run_ranks(args, world)
    result = json.loads((out / "result.json").read_text())
    result["exported"] = torch.load(out / "exported.pt")
    result["reference"] = torch.load(out / "reference.pt")
    result["ranks"] = [torch.load(out / f"exported_rank{r}.pt") for r in range(world)]
    return result


def test_zero3_two_processes_step_equals_one_process(tmp_path):
    model = tiny_model("qwen2")
    one = _run(model, tmp_path / "one", world=1, zero_stage=2)
    two = _run(model, tmp_path / "two", world=2, zero_stage=3)
    original = dict(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(model).named_parameters()
    )

    assert one["metrics"]["loss"] == pytest.approx(two["metrics"]["loss"], rel=1e-5)
    assert one["metrics"]["tokens"] == two["metrics"]["tokens"]
    # Adam's first step is scale-free (about lr * sign(g)); the gradient norm is not, so it checks
    # that the two ranks' gradients are averaged with the right weights
    assert one["metrics"]["grad_norm"] == pytest.approx(two["metrics"]["grad_norm"], rel=1e-5)
    assert list(one["exported"]) == list(two["exported"])
    for name, tensor in one["exported"].items():
        update_one, update_two = tensor - original[name], two["exported"][name] - original[name]
        assert update_one.abs().max() > 1e-3, f"{name} did not change"
        # where |g| is near Adam's eps, float rounding moves single elements by ~1% of lr
        torch.testing.assert_close(update_two, update_one, rtol=0, atol=3e-4, msg=name)
        assert (update_two - update_one).abs().mean() < 1e-6, name
    # the export is the model's own weights, on every rank, gathered in buckets
    for name, tensor in two["reference"].items():
        assert torch.equal(two["exported"][name], tensor), name
    assert all(torch.equal(two["ranks"][1][n], t) for n, t in two["ranks"][0].items())
    assert 1 < two["gathers"] < two["tensors"]


def test_zero3_lora_export_merges_adapters(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen2")
    two = _run(model, tmp_path / "lora", world=2, zero_stage=3, lora_rank=4)
    # rebuild the peft model from the gathered adapter and base weights, then merge with peft
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model),
        LoraConfig(
            r=4,
            lora_alpha=16,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            target_modules=list(LORA_TARGETS),
        ),
    )
    missing, unexpected = peft_model.load_state_dict(two["reference"], strict=False)
    tied = {"base_model.model.lm_head.weight"}  # the kit model ties it to the embeddings
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    merged = dict(peft_model.merge_and_unload().named_parameters())
    assert sorted(merged) == sorted(two["exported"])
    lora_b = [v for k, v in two["reference"].items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b), "the step did not train the adapters"
    for name, tensor in merged.items():
        torch.testing.assert_close(two["exported"][name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def test_zero3_export_over_three_ranks_cuts_the_padding_and_fills_the_senders_layout(tmp_path):
    """Three ranks: most parameters' partitions end in padding. At every bucket size (one
    smaller than any tensor included) and cast or not, every rank's export equals DeepSpeed's
    gather bit for bit (the worker asserts), one all-gather per bucket, and every bucket lies
    in one buffer exactly as a weightsync sender of that bucket size lays it out, so that it is
    sent without packing."""
    run_ranks([sys.executable, str(EXPORT_WORKER), str(tiny_model("qwen2")), str(tmp_path)], 3)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["padded"] > result["tensors"] // 2
    for key, (in_place, buckets) in result["in_place"].items():
        assert in_place == buckets, key
        assert result["gathers"][key] == buckets, key
    assert result["in_place"]["None/1073741824"][1] == 1


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ranks_with_different_micro_batch_counts_step_as_one_process(tmp_path, zero_stage):
    """Token budgets give ranks different numbers of micro-batches (here two and one). Every
    backward under ZeRO-2 and every forward under ZeRO-3 is a collective: before the ranks kept
    in step, ZeRO-2's step died (gloo: connection reset) and ZeRO-3's forward waited forever."""
    model = tiny_model("qwen2")
    runs = {}
    for name, world, stage in (("one", 1, 2), ("two", 2, zero_stage)):
        out = tmp_path / name
        out.mkdir()
        run_ranks(
            [sys.executable, str(UNEVEN_WORKER), str(model), str(out), str(stage)], world, 150
        )
        runs[name] = dict(
            metrics=json.loads((out / "metrics.json").read_text()),
            logprobs=[torch.load(out / f"logprobs_rank{r}.pt") for r in range(world)],
        )
    one, two = runs["one"], runs["two"]
    whole = one["logprobs"][0]
    # the ranks' rows, each trimmed of the columns padding in all of its rows (Batch.take)
    torch.testing.assert_close(two["logprobs"][0], whole[:3], rtol=0, atol=1e-5)
    torch.testing.assert_close(two["logprobs"][1], whole[3:, : two["logprobs"][1].shape[1]])
    assert one["metrics"]["tokens"] == two["metrics"]["tokens"] == 3 * 8 + 3 * 4
    assert one["metrics"]["loss"] == pytest.approx(two["metrics"]["loss"], rel=1e-5)
    # the padding passes add no gradient: the norm is the one process's
    assert one["metrics"]["grad_norm"] == pytest.approx(two["metrics"]["grad_norm"], rel=1e-5)
