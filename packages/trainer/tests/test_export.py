"""Weight export: Hugging Face names, tied weights once, LoRA merged, ZeRO-3 partitions joined."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from ferrule_testkit import tiny_model
from ferrule_trainer.export import WeightExport, export_weights, weight_specs


def test_export_is_the_hf_state_dict():
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
    exported = dict(export_weights(model))
    assert exported.keys() == model.state_dict().keys()  # untied: lm_head.weight included
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported[name], tensor), name


def test_tied_embeddings_export_once_and_cast():
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"))
    exported = dict(export_weights(model, dtype=torch.bfloat16))
    assert "lm_head.weight" not in exported and "model.embed_tokens.weight" in exported
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    specs = weight_specs(model, dtype=torch.bfloat16)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        (n, tuple(t.shape), t.dtype) for n, t in exported.items()
    ]


def test_lora_export_equals_merged_model():
    path = tiny_model("qwen2")
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora)
    torch.manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # B starts at zero: make the adapters matter
            param.data.normal_()
    exported = dict(export_weights(peft_model))
    merged = dict(peft_model.merge_and_unload().named_parameters())
    assert list(exported) == list(merged)  # HF names, in the model's order
    base = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    assert not torch.equal(
        exported["model.layers.0.self_attn.q_proj.weight"],
        base["model.layers.0.self_attn.q_proj.weight"],
    )
    for name, tensor in merged.items():
        assert torch.equal(exported[name], tensor), name


def test_zero3_export_of_one_rank_is_the_model_in_any_bucket_size():
    """Under ZeRO-3 with one rank each partition is the whole (padded) parameter: the export
    cuts the padding off and yields the model's weights, whatever the bucket size (a bucket
    smaller than one tensor included), cast when asked."""
    import deepspeed

    from ferrule_trainer.actor import Actor

    actor = Actor(tiny_model("qwen2"), zero_stage=3, dtype="float32", learning_rate=1e-3)
    expected = {}
    for name, param in actor.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            expected[name] = param.detach().clone()
    for bucket_bytes in (1 << 30, 4096, 1):
        exported = dict(actor.export_weights(bucket_bytes=bucket_bytes))
        assert exported.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(exported[name], tensor), (bucket_bytes, name)
    cast = dict(actor.export_weights(dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in cast.values())
    assert torch.equal(cast["model.norm.weight"], expected["model.norm.weight"].bfloat16())


def test_an_export_of_the_models_own_memory_is_in_place_and_follows_swapped_parameters():
    """In place: each tensor is a view of its parameter, which sees in-place changes and
    follows a parameter whose memory is swapped."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
    exporter = WeightExport(model)
    assert exporter.in_place
    first = dict(exporter.weights())
    params = dict(model.named_parameters())
    assert all(first[n].data_ptr() == params[n].data_ptr() for n in first)
    name = "model.layers.0.mlp.up_proj.weight"
    with torch.no_grad():
        params[name].mul_(2)  # what an optimizer step does
    assert torch.equal(dict(exporter.weights())[name], params[name])
    params[name].data = torch.full_like(params[name], 0.25)  # what an offload does
    swapped = dict(exporter.weights())[name]
    assert swapped.data_ptr() == params[name].data_ptr() and bool((swapped == 0.25).all())
    # a cast or a merge is not the model's own memory
    cast = WeightExport(model, torch.bfloat16)
    assert not cast.in_place and {t.dtype for _, t in cast.weights()} == {torch.bfloat16}
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    assert not WeightExport(get_peft_model(model, lora)).in_place


def test_zero3_export_of_one_rank_is_in_place_and_follows_its_partitions():
    import deepspeed

    from ferrule_trainer.actor import Actor

    actor = Actor(tiny_model("qwen2"), zero_stage=3, dtype="float32", learning_rate=1e-3)
    assert actor.export_in_place() and not actor.export_in_place(torch.bfloat16)
    params = dict(actor.module.named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    dict(actor.export_weights())
    with torch.no_grad():
        params[name].ds_tensor.mul_(3)  # an optimizer step, in place
    exported = dict(actor.export_weights())
    with deepspeed.zero.GatheredParameters([params[name]]):
        assert torch.equal(exported[name], params[name].detach())
    params[name].ds_tensor.data = params[name].ds_tensor.data * 0 + 0.5  # swapped out and in
    assert bool((dict(actor.export_weights())[name] == 0.5).all())


def test_partitions_lying_end_to_end_are_recognised():
    """The ZeRO-3 export sends a rank's partitions from where they lie when they are end to
    end in one storage; anything else is joined by a copy."""
    from ferrule_trainer.export import _end_to_end

    flat = torch.arange(20.0)
    row = _end_to_end([flat[0:3], flat[3:10], flat[10:20]])
    assert row.data_ptr() == flat.data_ptr() and torch.equal(row, flat)  # a view, no copy
    assert torch.equal(_end_to_end([flat[3:10], flat[10:12]]), flat[3:12])
    assert _end_to_end([flat[0:3], flat[4:10]]) is None  # a gap
    assert _end_to_end([flat[3:10], flat[0:3]]) is None  # out of order
    assert _end_to_end([flat[0:3], torch.arange(20.0)[3:10]]) is None  # another storage
    assert _end_to_end([flat[0:6:2], flat[6:10]]) is None  # not contiguous
