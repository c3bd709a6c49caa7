"""The decode step's compiled regions (regions.py): which modules, swapped in and back, the same
logits as eager, and one compile for each region's code however many layers share it."""

import pytest
import torch

from ferrule_rollout.regions import ROTARY, CompiledRegions
from ferrule_testkit import tiny_model


@pytest.fixture()
def model():
    from transformers import AutoModelForCausalLM

    path = tiny_model("qwen2", num_hidden_layers=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_the_regions_are_each_layers_pieces_but_its_attention_and_go_back_after(model):
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    regions = CompiledRegions(model)
    layers = model.model.layers
    wanted = [m for layer in layers for m in (layer.mlp, layer.input_layernorm)]
    wanted += [layer.post_attention_layernorm for layer in layers] + [model.model.norm]
    assert {id(m) for m in regions.modules} == {id(m) for m in wanted}
    assert len(regions) == len(wanted) + 1  # and the rotary function
    eager = qwen2.apply_rotary_pos_emb
    with pytest.raises(RuntimeError), regions.active():
        assert all("forward" in m.__dict__ for m in regions.modules)
        assert getattr(qwen2, ROTARY) is not eager
        raise RuntimeError("a failed capture")
    assert not any("forward" in m.__dict__ for m in regions.modules)
    assert getattr(qwen2, ROTARY) is eager
    with regions.active():  # another Decoder made meanwhile restores the eager function too
        other = CompiledRegions(model)
    with other.active():
        pass
    assert getattr(qwen2, ROTARY) is eager


def test_a_forward_through_the_regions_gives_the_eager_logits_compiling_each_code_once(model):
    """Three layers, three regions' codes (MLP, RMSNorm, rotary): three graphs, not ten."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    regions = CompiledRegions(model)
    ids = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids).logits
        with regions.active():
            compiled = model(ids).logits
            again = model(ids + 1).logits  # the same shapes: no new graph
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert not torch.equal(again, compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3


def test_a_model_that_names_no_decoder_layers_has_no_regions(model, monkeypatch):
    """Then the Decoder compiles its whole forward, as before regions (not an uncompiled step)."""
    monkeypatch.setattr(model, "_no_split_modules", [])
    regions = CompiledRegions(model)
    assert len(regions) == 0 and not regions
