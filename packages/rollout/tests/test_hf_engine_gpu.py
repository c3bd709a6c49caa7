"""TransformersEngine on a GPU: the CUDA-graph decode against a teacher-forced forward, seeds,
and graphs that follow in-place weight changes and the new storage after sleep / wake.

The kit model in float32 on the GPU (the engine's bf16 speed is benchmarks/rollout_gpu.py's).
"""

import sys
from pathlib import Path

import pytest
import torch

from ferrule_rollout import SamplingSettings
from ferrule_testkit import teacher_forced_logprobs, tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from rollout_helpers import assert_matches_transformers, perturb_

pytestmark = pytest.mark.gpu
PROMPTS = ["Question: what is 12 + 30? Answer:", "Reverse the string hello. Answer:", [5, 6, 7]]
GREEDY = SamplingSettings(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    from ferrule_rollout.hf_engine import TransformersEngine

    with TransformersEngine(tiny_model("qwen2"), dtype="float32", max_model_len=256) as engine:
        yield engine


def policy_of(engine):
    """A CPU transformers copy of the weights the engine holds now."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    model.load_state_dict({k: v.cpu() for k, v in engine._model.state_dict().items()})
    return model.eval()


def test_graphed_greedy_and_sampled_decode_match_a_teacher_forced_forward(engine):
    samples = engine.generate(PROMPTS, GREEDY)
    assert all(s.graph for s in engine._decoder.steps.values())
    assert all(len(s.token_ids) == 40 for s in samples)
    policy = policy_of(engine)
    assert_matches_transformers(samples, policy, greedy=True)
    settings = SamplingSettings(n=4, temperature=0.8, top_k=50, max_tokens=30, seed=3)
    sampled = engine.generate(PROMPTS, settings)
    assert_matches_transformers(sampled, policy, greedy=False, temperature=0.8, top_k=50)
    assert engine.generate(PROMPTS, settings) == sampled  # a seed reproduces
    alone = engine.generate(PROMPTS[:1], settings)  # in another rows bucket
    assert [s.token_ids for s in alone] == [s.token_ids for s in sampled[:4]]


def test_graphs_read_weights_changed_in_place_and_storage_after_wake(engine):
    before = engine.generate(PROMPTS, GREEDY)
    with torch.no_grad():  # as a weight update writes: into the same tensors
        cpu = policy_of(engine)
        perturb_(cpu, seed=5)
        for name, param in engine._model.named_parameters():
            param.copy_(cpu.get_parameter(name))
    changed = engine.generate(PROMPTS, GREEDY)
    assert [s.token_ids for s in changed] != [s.token_ids for s in before]
    assert_matches_transformers(changed, cpu, greedy=True)
    engine.sleep(1)
    assert engine._decoder is None
    engine.wake_up()
    assert engine.generate(PROMPTS, GREEDY) == changed


def test_eos_and_length_stop_on_the_device(engine):
    free = engine.generate(PROMPTS, SamplingSettings(n=2, max_tokens=50, seed=1, ignore_eos=True))
    extra = free[0].token_ids[20]
    engine._eos.add(extra)
    try:
        stopping = engine.generate(PROMPTS, SamplingSettings(n=2, max_tokens=50, seed=1))
        end = next(i for i, t in enumerate(free[0].token_ids) if t in engine._eos)
    finally:
        engine._eos.discard(extra)
    assert stopping[0].token_ids == free[0].token_ids[: end + 1]
    assert (
        stopping[0].finish_reason == "stop" and stopping[0].logprobs == free[0].logprobs[: end + 1]
    )
    long_prompt = [5] * 250  # 6 tokens left before max_model_len
    (capped,) = engine.generate([long_prompt], GREEDY)
    assert len(capped.token_ids) == 6 and capped.finish_reason == "length"


def test_compiled_decode_matches_a_teacher_forced_forward():
    from ferrule_rollout.hf_engine import TransformersEngine

    with TransformersEngine(
        tiny_model("qwen2"), dtype="float32", max_model_len=256, compile_decode=True
    ) as engine:
        samples = engine.generate(PROMPTS, GREEDY)
        assert all(s.graph for s in engine._decoder.steps.values())
        assert engine._decoder.step_forward is not engine._decoder.forward
        assert_matches_transformers(samples, policy_of(engine), greedy=True)
        # one compiled shape for every call: a held-out evaluation's few rows and short caps
        # share the training steps' compile (the engine's 256 rows x 256 slots)
        engine.generate(PROMPTS[:1], SamplingSettings(max_tokens=5))
        engine.generate(PROMPTS * 30, SamplingSettings(n=2, max_tokens=100))
        # (and the tail's 16 rows, if ever 16 or fewer samples still ran)
        assert (256, 256) in engine._decoder.steps
        assert set(engine._decoder.steps) <= {(16, 256), (256, 256)}


def test_continuous_batching_under_graphs_gives_what_one_batch_gives(engine):
    settings = SamplingSettings(n=3, max_tokens=30, seed=2)
    full = engine.generate(PROMPTS, settings)
    engine.max_batch_size = 2  # rows leave and queued ones take them, in the 2-row graph
    try:
        queued = engine.generate(PROMPTS, settings)
    finally:
        engine.max_batch_size = 256
    assert [s.token_ids for s in queued] == [s.token_ids for s in full]
    for a, b in zip(queued, full, strict=True):
        assert a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_a_kv_cache_of_few_pages_under_graphs_gives_the_same_samples(engine):
    """[rollout] kv_cache_tokens on the GPU: 4 pages for 8 rows of up to 256 slots, under CUDA
    graphs and the paged attention kernel; rows go back to the queue when the pages run out,
    and every sample is the default cache's. The draws' uniforms, made on the GPU, are the
    CPU's bit for bit."""
    from ferrule_rollout.hf_engine import TransformersEngine
    from ferrule_rollout.sampling import uniforms

    keys, first = [0, 1, 2**40 + 7, -5], [0, 3, 9, 100]
    assert torch.equal(uniforms(keys, 300, first, "cuda").cpu(), uniforms(keys, 300, first))
    settings = SamplingSettings(n=4, max_tokens=120, ignore_eos=True, seed=11)
    roomy = engine.generate(PROMPTS, settings)
    with TransformersEngine(
        tiny_model("qwen2"),
        dtype="float32",
        max_model_len=256,
        max_batch_size=8,
        kv_cache_tokens=256,
    ) as tight:
        got = tight.generate(PROMPTS, settings)
        assert tight._decoder.cache.paged_reads and tight._decoder.requeued > 0
    assert [s.token_ids for s in got] == [s.token_ids for s in roomy]
    for a, b in zip(got, roomy, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


@pytest.fixture(scope="module")
def real_size():
    """A Qwen2.5-1.5B-shaped model with the real vocabulary, and prompts of 16-64 tokens."""
    from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 65, (12,), generator=generator).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]
    return tiny_model("qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B), prompts


def k3(samples, theirs) -> float:
    """The launcher's vllm_kl: the k3 estimate of KL(engine || trainer) per token."""
    log_ratio = torch.cat(theirs) - torch.cat([torch.tensor(s.logprobs) for s in samples])
    return (log_ratio.exp() - 1 - log_ratio).mean().item()


def test_the_decode_attention_kernel_in_bf16_equals_sdpa_at_real_head_shapes():
    """kernels.decode_attention at Qwen2.5-1.5B's heads (12 query heads over 2 KV heads of 128) in bf16:
    against sdpa with the same mask, rows anywhere from their first slot to the slab's last."""
    import torch.nn.functional as F

    from ferrule_rollout.kernels import PAGE, decode_attention, supports

    rows, kv, group, dim, length = 96, 2, 6, 128, 576
    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(rows, 1, kv * group, dim, device="cuda", generator=g).bfloat16()
    query = query.transpose(1, 2)
    keys, values = (
        torch.randn(rows, kv, length, dim, device="cuda", generator=g).bfloat16() for _ in "kv"
    )
    slots = torch.randint(0, length, (rows,), device="cuda", generator=g)
    pads = (torch.rand(rows, device="cuda", generator=g) * slots).long()
    where = torch.arange(length, device="cuda")
    visible = ((where >= pads[:, None]) & (where <= slots[:, None])) | (where == slots[:, None])
    assert supports(kv * group, kv, dim)
    # each row's pages in shuffled order among the pool's (page 0: none of them)
    width = length // PAGE
    table = (torch.randperm(rows * width, device="cuda", generator=g) + 1).view(rows, width)
    pools = []
    for dense in (keys, values):
        pool = torch.zeros(1 + rows * width, kv, PAGE, dim, device="cuda", dtype=dense.dtype)
        pool[table.flatten()] = dense.view(rows, kv, width, PAGE, dim).transpose(1, 2).flatten(0, 1)
        pools.append(pool)
    got = decode_attention(query, *pools, visible, slots, table, dim**-0.5)
    want = (
        F.scaled_dot_product_attention(
            query.reshape(rows, kv, group, dim).float(),
            keys.float(),
            values.float(),
            attn_mask=visible[:, None, None, :],
        )
        .reshape(rows, kv * group, 1, dim)
        .transpose(1, 2)
    )
    assert (got.float() - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("mode", ["graphs", "compiled", "exact"])
def test_at_real_size_logprobs_agree_with_the_trainers_forward(real_size, mode):
    """bf16 at 1.5B: vllm_kl <= 1e-3 with graphs (kernels.decode_attention) and compiled;
    bit for bit in exact mode. In exact mode
    continuous batching (4 rows at a time) and each prompt alone also give the same tokens and
    logprobs as one batch (batch invariance), here greedy."""
    from transformers import AutoModelForCausalLM

    from ferrule_rollout.exact import ExactNumerics
    from ferrule_rollout.hf_engine import TransformersEngine

    path, prompts = real_size
    exact = mode == "exact"
    settings = SamplingSettings(n=2, max_tokens=128, ignore_eos=True, seed=4)
    with TransformersEngine(
        path, dtype="bfloat16", max_model_len=512, exact=exact, compile_decode=mode == "compiled"
    ) as engine:
        samples = engine.generate(prompts, settings)
        if exact:
            greedy = SamplingSettings(max_tokens=64, temperature=0.0, ignore_eos=True)
            together = engine.generate(prompts, greedy)
            alone = [engine.generate([p], greedy)[0] for p in prompts[:3]]
            engine.max_batch_size = 4
            queued = engine.generate(prompts, greedy)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    if exact:
        ExactNumerics(512).apply(model)
    theirs = teacher_forced_logprobs(model, samples, micro_batch=8)
    if not exact:
        assert k3(samples, theirs) <= 1e-3
        return
    for sample, expected in zip(samples, theirs, strict=True):
        assert torch.equal(torch.tensor(sample.logprobs), expected)
    assert k3(samples, theirs) == 0.0

    def outputs(samples):
        return [(s.token_ids, s.logprobs) for s in samples]

    assert outputs(queued) == outputs(together)
    assert outputs(alone) == outputs(together[:3])


def test_exact_modes_gradients_repeat_bit_for_bit():
    """The trainer's side of exact mode: the same left-padded bf16 batch at real head shapes
    (12 query heads, 2 KV heads, 128 wide, 512 positions) gives the same gradients, bit for bit,
    twice in a row. sdpa's fused backward kernels (cuDNN's, memory-efficient) did not on an H200,
    so a resumed exact run could not end with the uninterrupted run's weights."""
    from transformers import AutoModelForCausalLM

    from ferrule_rollout.exact import ExactNumerics

    path = tiny_model(
        "qwen2",
        hidden_size=1536,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    ExactNumerics(512).apply(model)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (8, 512), generator=generator).cuda()
    lengths = torch.randint(100, 512, (8,), generator=generator).cuda()
    mask = (torch.arange(512, device="cuda")[None] >= (512 - lengths)[:, None]).long()

    def gradients():
        model.zero_grad(set_to_none=True)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
        (logits.float().log_softmax(-1)[..., 7] * mask).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    first, second = gradients(), gradients()
    differ = [name for name in first if not torch.equal(first[name], second[name])]
    assert not differ, f"gradients differ between two identical backward passes: {differ}"


def test_the_tails_rows_move_into_a_narrower_graph_mid_call(engine):
    """The tail's compaction under CUDA graphs: the narrower step is captured in the middle of
    the call (its capture writes only the slab's last slot, which no sample reaches) and every
    sample is the one the same call gives without moving."""
    from ferrule_rollout.decode import SLOT_ALIGN, Decoder

    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (int(n),), generator=generator).tolist() for n in range(3, 67)]
    limits = [
        min(90, 2 + int(x)) for x in torch.empty(64).exponential_(1 / 10, generator=generator)
    ]
    limits[7] = 90
    settings = dict(pad=0, keys=list(range(64)), temperature=1.0, top_k=0, top_p=1.0, eos=None)
    model = engine._model
    moving = Decoder(model, float_mask=False, compact=4)
    still = Decoder(model, float_mask=False, compact=0)
    moved = moving.generate(prompts, limits, **settings)
    # the slab: the longest prompt + its own limit, in whole SLOT_ALIGN slots (before 277f029
    # the widest prompt + the largest limit: 192 slots here, where 128 hold every sequence)
    longest = max(len(p) + limit for p, limit in zip(prompts, limits, strict=True))
    slots = -(-(longest - 1) // SLOT_ALIGN) * SLOT_ALIGN
    assert slots == 128
    assert sorted(moving.steps) == [(16, slots), (64, slots)]  # 64 rows, then the last 16 or fewer
    assert all(step.graph is not None for step in moving.steps.values())
    expected = still.generate(prompts, limits, **settings)
    for (tokens, logprobs, n, _), (their_tokens, theirs, their_n, _) in zip(
        moved, expected, strict=True
    ):
        assert (tokens, n) == (their_tokens, their_n)
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(theirs), atol=1e-4)
