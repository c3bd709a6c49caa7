"""TransformersEngine on a kit model: greedy output against vLLM's (the acceptance test), logprobs
against a teacher-forced transformers forward, sampling settings, weight updates through both
CPU transports, pause / resume, sleep, bad input.

One engine serves the module; the `policy` fixture keeps a transformers copy of whatever weights
the engine holds, so each test can check against it. Only the tests that start vLLM (or a fresh
interpreter) are slow.
"""

import ast
import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ferrule_rollout import BadRequestError, RolloutError, SamplingSettings
from ferrule_testkit import tiny_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from rollout_helpers import (
    LOGPROB_ATOL,
    assert_matches_transformers,
    free_port,
    hf_logprobs,
    in_thread,
    perturb_,
    perturbed_and_loaded,
)

PROMPTS = ["Question: what is 12 + 30? Answer:", "Reverse the string hello. Answer:"]
# Varied lengths (1 to 41 tokens, text and ids) so that left padding and chunks matter.
VARIED = [*PROMPTS, "a", "The cat sat on the mat and then", "x " * 40, [5, 6, 7, 8, 9]]
GREEDY = SamplingSettings(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    from ferrule_rollout.hf_engine import TransformersEngine

    with TransformersEngine(tiny_model("qwen2"), dtype="float32", max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def policy(engine):
    """The transformers model holding the weights the engine holds now."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """The kit model with its greedy continuation of PROMPTS[0]'s first token as a second EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ids = torch.tensor([AutoTokenizer.from_pretrained(source).encode(PROMPTS[0])])
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(source, path)
    return add_eos(path, int(model(ids).logits[0, -1].argmax()))


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    """A tiny GPT-2: learned absolute positions (the kit's rotary models see only relative ones,
    so position ids that ignore left padding would not change their output)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer())
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=256, n_embd=64, n_layer=2, n_head=2, **ids
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(50)  # positions that matter at float32 resolution
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def add_eos(folder: Path, token: int) -> Path:
    """List `token` as a second end-of-sequence token in generation_config.json (both engines
    stop on every token of that list)."""
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], token]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def connect(engine, transport: str):
    from ferrule_weightsync import create_sender

    port = free_port()
    # Small buckets: tensors straddle them, as a real model's do at 256 MB.
    joining = in_thread(
        create_sender, transport, "127.0.0.1", port, 1, bucket_bytes=64 * 1024, timeout=60
    )
    engine.init_weight_sync(transport, "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
    return joining.get()


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_greedy_output_equals_vllm_token_for_token(eos_model, vllm_cpu_env):
    from ferrule_rollout.hf_engine import TransformersEngine
    from ferrule_rollout.vllm_engine import VLLMEngine

    long_prompt = [5] * 250  # 6 tokens left before max_model_len
    cases = [
        (VARIED, GREEDY),
        (VARIED, SamplingSettings(temperature=0.0, max_tokens=12)),  # EOS from the config list
        (VARIED, SamplingSettings(temperature=0.0, max_tokens=12, stop=["dd", "^^^"])),
        ([*VARIED[:2], long_prompt], GREEDY),  # the length cap under a shorter prompt's padding
    ]
    # max_batch_size 4: each batch of six prompts runs as two chunks of different widths.
    with TransformersEngine(eos_model, dtype="float32", max_model_len=256, max_batch_size=4) as hf:
        ours = [hf.generate(prompts, settings) for prompts, settings in cases]
    with VLLMEngine(eos_model, dtype="float32", max_model_len=256) as vllm:
        theirs = [vllm.generate(prompts, settings) for prompts, settings in cases]
    for got, expected in zip(ours, theirs, strict=True):
        for a, b in zip(got, expected, strict=True):
            assert (a.prompt_token_ids, a.token_ids) == (b.prompt_token_ids, b.token_ids)
            assert (a.finish_reason, a.text) == (b.finish_reason, b.text)
            diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max()
            assert diff < LOGPROB_ATOL, (a.prompt_index, diff)
    reasons = [[s.finish_reason for s in samples] for samples in ours]
    assert reasons[1][0] == "stop" and ours[1][0].token_ids == theirs[0][0].token_ids[:1]
    assert "stop" in reasons[2] and reasons[3] == ["length"] * 3
    assert len(ours[3][2].token_ids) == 6


def test_greedy_matches_a_teacher_forced_forward_in_any_chunking(engine, policy):
    samples = engine.generate(VARIED, GREEDY)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, 0) for p in range(6)]
    assert all(len(s.token_ids) == 12 and s.finish_reason == "length" for s in samples)
    assert_matches_transformers(samples, policy, greedy=True)
    engine.max_batch_size = 2
    try:
        chunked = engine.generate(VARIED, GREEDY)
    finally:
        engine.max_batch_size = 256
    assert [s.token_ids for s in chunked] == [s.token_ids for s in samples]


def test_compact_rows_reaches_the_decoder(engine):
    """The [rollout] compact_rows key turns the tail's compaction (test_decode.py) on and off."""
    from ferrule_rollout.hf_engine import TransformersEngine

    engine.generate(VARIED[:1], GREEDY)
    assert engine._decoder.compacts == 16
    with TransformersEngine(tiny_model("qwen2"), dtype="float32", compact_rows=False) as still:
        still.generate(VARIED[:1], GREEDY)
        assert not still._decoder.compacts


def test_a_kv_cache_of_fewer_tokens_than_the_rows_gives_the_same_samples(engine):
    """[rollout] kv_cache_tokens: 4 pages (256 tokens) for 8 rows of up to 256 slots; rows wait
    for pages or go back to the queue, and every sample equals the one of a cache of rows x
    max_model_len (the engine fixture's). Less than max_model_len is refused."""
    from ferrule_rollout.hf_engine import TransformersEngine

    settings = SamplingSettings(n=4, max_tokens=120, ignore_eos=True, seed=11)
    roomy = engine.generate(VARIED[:4], settings)
    model = tiny_model("qwen2")
    with TransformersEngine(
        model, dtype="float32", max_model_len=256, max_batch_size=8, kv_cache_tokens=256
    ) as tight:
        for got, want in zip(tight.generate(VARIED[:4], settings), roomy, strict=True):
            assert got.token_ids == want.token_ids
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert tight._decoder.requeued > 0
    with pytest.raises(RolloutError, match="kv_cache_tokens 100 cannot hold one sequence"):
        TransformersEngine(model, dtype="float32", max_model_len=256, kv_cache_tokens=100)


def test_left_padded_rows_keep_their_absolute_positions(gpt2_model):
    from transformers import AutoModelForCausalLM

    from ferrule_rollout.hf_engine import TransformersEngine

    with TransformersEngine(gpt2_model, dtype="float32") as engine:
        samples = engine.generate(VARIED, GREEDY)
    model = AutoModelForCausalLM.from_pretrained(gpt2_model, dtype=torch.float32).eval()
    assert_matches_transformers(samples, model, greedy=True)


def test_sampled_logprobs_are_those_of_the_sampling_distribution(engine, policy):
    settings = SamplingSettings(n=3, temperature=0.8, top_k=50, max_tokens=10, seed=7)
    samples = engine.generate([*PROMPTS, [5, 6, 7, 8]], settings)
    assert len(samples) == 9 and samples[0].token_ids != samples[1].token_ids
    assert_matches_transformers(samples, policy, greedy=False, temperature=0.8, top_k=50)
    # The raw logits' logprobs are measurably different: the check above can tell them apart.
    raw, _ = hf_logprobs(policy, samples[0].prompt_token_ids, samples[0].token_ids)
    assert (raw - torch.tensor(samples[0].logprobs)).abs().max() > 0.05
    plain = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=0.7, max_tokens=10, seed=3))
    assert_matches_transformers(plain, policy, greedy=False, temperature=0.7)


def test_sampling_logprobs_by_hand():
    from ferrule_rollout.hf_engine import sampling_logprobs

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.bfloat16)
    got = sampling_logprobs(logits, temperature=1.0, top_k=0, top_p=0.8)
    # softmax [.644 .237 .087 .032]: the two least likely hold .119 <= 1 - 0.8, so they go.
    inf = float("-inf")
    assert got.dtype == torch.float32
    assert torch.allclose(got, torch.tensor([[-0.31326, -1.31326, inf, inf]]), atol=1e-4)
    halved = sampling_logprobs(logits, temperature=0.5, top_k=3, top_p=1.0)
    assert torch.allclose(halved, torch.log_softmax(torch.tensor([[4.0, 2.0, 0.0, inf]]), -1))
    greedy = sampling_logprobs(logits, temperature=0, top_k=1, top_p=0.5)  # truncation ignored
    assert torch.allclose(greedy, torch.log_softmax(logits.float(), -1))


def test_n_samples_order_seeds_and_stream(engine):
    settings = SamplingSettings(n=3, max_tokens=7, ignore_eos=True, seed=5)
    samples = engine.generate(PROMPTS, settings)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, i) for p in range(2) for i in range(3)
    ]
    assert all(len(s.token_ids) == len(s.logprobs) == 7 for s in samples)
    assert all(s.finish_reason == "length" and s.versions[0].end == 7 for s in samples)
    assert engine.generate(PROMPTS, settings) == samples  # a seed reproduces
    # Sample i uses seed + i, whatever else is in the batch.
    fewer = engine.generate(
        PROMPTS[:1], SamplingSettings(n=2, max_tokens=7, ignore_eos=True, seed=5)
    )
    assert [s.token_ids for s in fewer] == [s.token_ids for s in samples[:2]]
    other = engine.generate(PROMPTS, SamplingSettings(n=3, max_tokens=7, ignore_eos=True, seed=6))
    assert [s.token_ids for s in other] != [s.token_ids for s in samples]
    stream = engine.generate_stream(PROMPTS, settings)
    assert next(stream) == samples[0]
    stream.close()
    assert list(stream) == []


def test_reseed_repeats_unseeded_samples_whatever_came_before(engine):
    """What a resumed run relies on: after reseed(s), unseeded samples are the same whether or
    not the engine generated anything before."""
    settings = SamplingSettings(n=2, max_tokens=7, ignore_eos=True, temperature=1.0)
    engine.reseed(11)
    first = engine.generate(PROMPTS, settings)
    assert engine.generate(PROMPTS, settings) != first  # the key stream moves on
    engine.reseed(11)
    assert engine.generate(PROMPTS, settings) == first


def test_stop_strings_end_samples_and_are_cut_from_the_text(engine):
    text = engine.generate(PROMPTS[:1], GREEDY)[0].text
    stop = text[3:6]
    (sample,) = engine.generate(PROMPTS[:1], SamplingSettings(temperature=0, stop=[stop]))
    assert sample.finish_reason == "stop" and stop not in sample.text
    assert len(sample.token_ids) < 16 and stop in engine.tokenizer.decode(sample.token_ids)


def test_eos_ends_a_sample_and_is_kept_in_its_tokens(engine, policy, tmp_path):
    from ferrule_rollout.hf_engine import TransformersEngine

    settings = SamplingSettings(n=4, temperature=1.5, max_tokens=30, seed=1, ignore_eos=True)
    free = engine.generate(PROMPTS, settings)
    # A second EOS: a token sample 0 draws first at position k > 0.
    drawn = free[0].token_ids
    k = next(k for k in range(1, 30) if drawn[k] not in drawn[:k])
    policy.save_pretrained(tmp_path)  # the weights the engine holds now
    engine.tokenizer.save_pretrained(tmp_path)
    with TransformersEngine(add_eos(tmp_path, drawn[k]), dtype="float32") as stopping_engine:
        eos = stopping_engine._eos
        stopping = stopping_engine.generate(PROMPTS, replace(settings, ignore_eos=False))
    assert len(stopping[0].token_ids) == k + 1 and drawn[k] in eos
    for sample, unbounded in zip(stopping, free, strict=True):
        # The same seeds draw the same tokens, up to the first EOS, which ends the sample.
        end = next((i for i, t in enumerate(unbounded.token_ids) if t in eos), None)
        if end is None:
            assert sample.token_ids == unbounded.token_ids and sample.finish_reason == "length"
            continue
        assert sample.token_ids == unbounded.token_ids[: end + 1]
        assert sample.finish_reason == "stop"
        assert sample.logprobs == pytest.approx(unbounded.logprobs[: end + 1], abs=1e-5)
        text = engine.tokenizer.decode(sample.token_ids[:-1], skip_special_tokens=True)
        assert sample.text == text  # without the EOS token's text, as vLLM writes it


@pytest.mark.parametrize(
    "prompts, match",
    [
        (["x " * 400], "maximum length is 256"),
        ([""], "prompt 0 is empty"),
        ([[1, 2, 10_000]], "outside the vocabulary"),
        (["fine", None], "prompt 1 must be a string or a list of token ids"),
        ("just a string", "must be a list"),
    ],
)
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(engine, prompts, match):
    with pytest.raises(BadRequestError, match=match):
        engine.generate(prompts, GREEDY)
    assert len(engine.generate(PROMPTS[:1], GREEDY)) == 1


def test_the_engine_says_where_its_start_went(engine):
    seconds = engine.startup_seconds()
    assert seconds.keys() == {"imports", "weights"} and seconds["weights"] > 0


def test_bad_model_path_and_dtype_name_themselves():
    from ferrule_rollout.hf_engine import TransformersEngine

    with pytest.raises(RolloutError, match="model path '/no/such/model' does not exist"):
        TransformersEngine("/no/such/model")
    with pytest.raises(RolloutError, match=r"dtype must be one of .* got 'float64'"):
        TransformersEngine(tiny_model("qwen2"), dtype="float64")
    with pytest.raises(
        RolloutError, match="max_model_len 4096 does not fit the model's length 512"
    ):
        TransformersEngine(tiny_model("qwen2"), max_model_len=4096)


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_update_loads_the_sent_weights_exactly(engine, policy, transport):
    from ferrule_weightsync import digest

    before = engine.generate(PROMPTS, GREEDY)
    sender = connect(engine, transport)
    try:
        perturb_(policy, seed=len(transport))
        version = engine.version
        sending = in_thread(sender.send, list(policy.named_parameters()), version=version + 1)
        assert engine.update_weights(timeout=60) == version + 1 == sending.get()
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    after = engine.generate(PROMPTS, GREEDY)
    assert all(s.version == version + 1 and s.versions[0].version == version + 1 for s in after)
    assert_matches_transformers(after, policy, greedy=True)
    old, new = (torch.tensor([s.logprobs for s in samples]) for samples in (before, after))
    assert (old - new).abs().max() > 0.1
    held = engine._model.state_dict()
    assert all(torch.equal(held[name], t) for name, t in policy.state_dict().items())
    assert engine.weights_digest() == digest(policy.named_parameters())


def assert_laid_out(engine) -> None:
    """Every parameter in one allocation per dtype, in the model's order, each start 16-byte
    aligned and the next one right after it."""
    from ferrule_rollout.hf_engine import PARAMETER_ALIGNMENT

    end: dict = {}  # dtype -> (allocation, byte offset where the last parameter ended)
    for name, param in engine._model.named_parameters():
        allocation = param.untyped_storage().data_ptr()
        start = param.storage_offset() * param.element_size()
        assert param.is_contiguous() and param.device == engine.device, name
        assert start % PARAMETER_ALIGNMENT == 0, name
        if param.dtype in end:
            assert end[param.dtype][0] == allocation, f"{name} lies in an allocation of its own"
            assert start - end[param.dtype][1] in range(PARAMETER_ALIGNMENT), name
        end[param.dtype] = (allocation, start + param.numel() * param.element_size())


def test_parameters_lie_in_one_allocation_and_an_update_loads_each_bucket_in_one_copy(
    engine, policy, monkeypatch
):
    """Laid out as the update comes (the sender's buckets hold these tensors end to end), the
    load of each bucket is one copy."""
    from ferrule_weightsync import digest

    assert_laid_out(engine)
    copies, foreach_copy = [], torch._foreach_copy_

    def counted(targets, sources):
        if threading.current_thread() is threading.main_thread():  # the engine's, not the sender's
            copies.append(len(targets))
        foreach_copy(targets, sources)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    perturbed_and_loaded(engine, connect(engine, "ipc"), policy, seed=7)
    assert len(copies) > 2 and set(copies) == {1}  # several 64 KB buckets, one copy each
    assert engine.weights_digest() == digest(policy.named_parameters())
    assert_laid_out(engine)


def test_a_tied_weight_loads_under_either_name(engine, policy):
    sender = connect(engine, "ipc")
    try:
        with torch.no_grad():
            policy.lm_head.weight.mul_(-1.5)  # the embedding too: one tensor
        sending = in_thread(sender.send, [("lm_head.weight", policy.lm_head.weight)])
        engine.update_weights(timeout=60)
        sending.get()
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    embedding = engine._model.get_input_embeddings().weight
    assert torch.equal(embedding, policy.model.embed_tokens.weight)
    assert_matches_transformers(engine.generate(PROMPTS, GREEDY), policy, greedy=True)


def test_unknown_names_and_shapes_are_refused_before_any_weight_changes(engine, policy):
    from ferrule_weightsync import MismatchError

    sender = connect(engine, "broadcast")
    digest, version = engine.weights_digest(), engine.version
    try:
        for bad, match in [
            (("model.no_such_layer.weight", torch.zeros(3)), "model.no_such_layer.weight"),
            (("lm_head.weight", torch.zeros(3, 3)), r"lm_head.weight.*\(3, 3\)"),
        ]:
            sending = in_thread(sender.send, [bad])
            with pytest.raises(RolloutError, match=match):
                engine.update_weights(timeout=60)
            with pytest.raises(MismatchError):
                sending.get()
            assert engine.health()["status"] == "serving" and engine.version == version
            assert engine.weights_digest() == digest
        # the group is still in step: a good update goes through
        sending = in_thread(sender.send, list(policy.named_parameters()), version=version + 7)
        assert engine.update_weights(timeout=60) == version + 7 == sending.get()
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    assert_matches_transformers(engine.generate(PROMPTS, GREEDY), policy, greedy=True)


def test_a_sender_that_never_sends_times_out_and_leaves_the_weights_alone(engine, policy):
    from ferrule_weightsync import PeerTimeoutError

    sender = connect(engine, "broadcast")
    try:
        version = engine.version
        with pytest.raises(RolloutError, match="weight update failed") as caught:
            engine.update_weights(timeout=1.0)
        assert isinstance(caught.value.__cause__, PeerTimeoutError)
        assert engine.health()["status"] == "serving" and engine.version == version
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    assert_matches_transformers(engine.generate(PROMPTS, GREEDY), policy, greedy=True)


def test_an_update_waits_for_the_running_call_and_paused_calls_queue(engine, policy):
    sender = connect(engine, "ipc")
    start = engine.version
    settings = SamplingSettings(n=2, max_tokens=32, ignore_eos=True, seed=1)
    try:
        running = in_thread(engine.generate, ["client says", [7, 8, 10]], settings)
        assert wait_until(lambda: engine.health()["running"] > 0)
        perturb_(policy, seed=99)
        sending = in_thread(sender.send, list(policy.named_parameters()), version=start + 1)
        assert engine.update_weights(timeout=60) == start + 1 == sending.get()
        assert {s.version for s in running.get()} == {start}  # finished on the old weights
        # While paused, calls queue (nothing is lost) and an update keeps the engine paused.
        engine.pause()
        late = [in_thread(engine.generate, [f"late {i}", [9, i + 20]], settings) for i in range(3)]
        assert wait_until(lambda: engine.health()["queued"] == 12)
        perturb_(policy, seed=98)
        sending = in_thread(sender.send, list(policy.named_parameters()), version=start + 2)
        assert engine.update_weights(timeout=60) == start + 2 == sending.get()
        assert engine.paused and engine.health()["queued"] == 12
        engine.resume()
        samples = [s for call in late for s in call.get()]
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    assert len(samples) == 12 and {s.version for s in samples} == {start + 2}
    assert_matches_transformers(samples, policy, greedy=False)


def test_keep_mode_is_refused_with_what_to_use_instead(engine):
    for call in (engine.pause, engine.update_weights):
        with pytest.raises(BadRequestError, match='only supports pause mode "wait"'):
            call(mode="keep")
    assert not engine.paused


def test_sleep_and_wake_up_are_no_ops_on_cpu(engine, caplog):
    before = engine.generate(PROMPTS, GREEDY)
    with caplog.at_level("INFO", logger="ferrule_rollout.hf_engine"):
        engine.sleep()
        engine.wake_up()
    assert "not supported on cpu" in caplog.text and engine.health()["status"] == "serving"
    assert engine.generate(PROMPTS, GREEDY) == before


def test_sleep_levels_free_and_restore_the_weights(engine, policy, monkeypatch):
    """The CUDA path, run on the CPU: level 1 keeps the weights, level 2 drops them until a
    weight update has loaded every one."""
    before = engine.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(engine, "_can_sleep", True)
    engine.sleep(1)
    engine.wake_up()
    assert_laid_out(engine)
    assert engine.generate(PROMPTS, GREEDY) == before
    engine.sleep(2)
    assert engine._model.lm_head.weight.numel() == 0 and engine.health()["status"] == "paused"
    waiting = in_thread(engine.generate, PROMPTS, GREEDY)
    assert wait_until(lambda: engine.health()["queued"] == 2)
    sender = connect(engine, "ipc")
    try:
        with pytest.raises(RolloutError, match="asleep"):
            engine.update_weights(timeout=5)
        engine.wake_up()
        with pytest.raises(RolloutError, match=r"dropped by sleep\(level=2\)"):
            waiting.get()
        assert engine.health()["status"] == "broken"
        sending = in_thread(sender.send, list(policy.named_parameters()))
        engine.update_weights(timeout=60)
        sending.get()
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    assert_laid_out(engine)
    assert engine.health()["status"] == "serving"
    after = engine.generate(PROMPTS, GREEDY)
    assert [s.token_ids for s in after] == [s.token_ids for s in before]
    assert_matches_transformers(after, policy, greedy=True)


def test_the_module_never_imports_vllm():
    import ferrule_rollout.hf_engine as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "vllm" not in imported and {"torch", "transformers"} <= imported


@pytest.mark.e2e  # ~9 s: an interpreter of its own
def test_it_generates_where_vllm_cannot_be_imported():
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now fails
        "from ferrule_rollout import SamplingSettings, TransformersEngine\n"
        f"engine = TransformersEngine({str(tiny_model('qwen2'))!r})\n"
        "print(len(engine.generate(['hi'], SamplingSettings(max_tokens=3, ignore_eos=True))[0].token_ids))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("3")


def test_a_cut_call_continued_gives_the_samples_of_one_uncut_call(engine):
    """Partial rollouts: with cut_below the call ends once few rows still run, those samples
    coming back as a prefix ("abort", with their draws' key). Continued (`Continuation`, one
    sample each whatever n) under the same weights, each is the uncut call's sample token for
    token, its logprobs kept; continued under a later version, its spans say which tokens each
    version drew. A `final` continuation is never cut; bad continuations are refused."""
    from ferrule_rollout import Continuation, VersionSpan

    prompts, v = ["a b c", "d e"], engine.version  # earlier tests may have loaded weights
    settings = SamplingSettings(n=16, max_tokens=150, seed=1, stop=("q",))
    full = engine.generate(prompts, settings)
    cut = engine.generate(prompts, replace(settings, cut_below=8))
    aborted = [s for s in cut if s.finish_reason == "abort"]
    assert 1 <= len(aborted) < 8, sorted(len(s.token_ids) for s in full)
    by_place = {(s.prompt_index, s.sample_index): s for s in full}
    for sample in cut:
        whole = by_place[sample.prompt_index, sample.sample_index]
        if sample.finish_reason != "abort":
            assert (sample.token_ids, sample.text, sample.draw_key) == (
                whole.token_ids,
                whole.text,
                None,
            )
            continue
        assert whole.token_ids[: len(sample.token_ids)] == sample.token_ids
        assert len(sample.token_ids) < len(whole.token_ids) and sample.draw_key is not None
    more = engine.generate([Continuation(s) for s in aborted], settings)
    assert len(more) == len(aborted)
    for before, after in zip(aborted, more, strict=True):
        whole = by_place[before.prompt_index, after.sample_index]
        assert after.sample_index == before.sample_index
        assert (after.token_ids, after.finish_reason, after.text) == (
            whole.token_ids,
            whole.finish_reason,
            whole.text,
        )
        assert after.prompt_token_ids == whole.prompt_token_ids
        assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(whole.logprobs), atol=1e-5)
        assert after.versions == [VersionSpan(v, 0, len(whole.token_ids))] and after.version == v
    # under later weights (the version update_weights would set), each stretch keeps its own
    engine._version = v + 3
    try:
        later = engine.generate([Continuation(aborted[0])], settings)[0]
    finally:
        engine._version = v
    n = len(aborted[0].token_ids)
    assert later.version == v and later.versions == [
        VersionSpan(v, 0, n),
        VersionSpan(v + 3, n, len(later.token_ids)),
    ]
    assert later.logprobs[:n] == aborted[0].logprobs
    final = engine.generate(
        [Continuation(s, final=True) for s in aborted], replace(settings, cut_below=64)
    )
    assert all(s.finish_reason != "abort" for s in final)
    with pytest.raises(BadRequestError, match="prompt 0 continues a sample that was not cut"):
        engine.generate([Continuation(full[0])], settings)
    with pytest.raises(
        BadRequestError, match=r"prompt 0 continues a sample of .* tokens; max_tokens"
    ):
        engine.generate(
            [Continuation(aborted[0])], replace(settings, max_tokens=len(aborted[0].token_ids))
        )
    with pytest.raises(BadRequestError, match="cut_below must be >= 0"):
        SamplingSettings(cut_below=-1)
    assert engine.generate(["a b"], GREEDY)  # and it keeps serving


def test_reuse_cut_kv_resumes_the_continued_samples_without_a_prefill(monkeypatch):
    """[rollout] reuse_cut_kv: the engine's next call continues the cut samples in the rows
    that hold their keys and values (no prefill), and gives each the uncut call's sample."""
    from ferrule_rollout import Continuation, decode
    from ferrule_rollout.hf_engine import TransformersEngine

    settings = SamplingSettings(n=16, max_tokens=150, seed=1, stop=("q",))
    model = tiny_model("qwen2")
    with TransformersEngine(model, dtype="float32", max_model_len=256, reuse_cut_kv=True) as engine:
        full = {(s.prompt_index, s.sample_index): s for s in engine.generate(["a b c"], settings)}
        cut = engine.generate(["a b c"], replace(settings, cut_below=8))
        aborted = [s for s in cut if s.finish_reason == "abort"]
        assert aborted
        prefilled = []
        take = decode._Rows.take
        monkeypatch.setattr(
            decode._Rows, "take", lambda rows, *a: prefilled.append(a[2]) or take(rows, *a)
        )
        more = engine.generate([Continuation(s) for s in aborted], settings)
    assert prefilled == []
    for before, after in zip(aborted, more, strict=True):
        whole = full[before.prompt_index, before.sample_index]
        assert (after.token_ids, after.finish_reason) == (whole.token_ids, whole.finish_reason)
        assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(whole.logprobs), atol=1e-5)
