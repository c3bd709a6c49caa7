"""`rlhf-rollout serve` as a user runs it: the real CLI in its own process, driven over gRPC.

One server for the module (its engine start costs 10-40 s), with a token, so every call here
is an authenticated one. Weight updates come from a shared-memory sender in this process, as a
colocated trainer's would.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from ferrule_grpc_auth import bearer
from ferrule_rollout import SamplingSettings
from ferrule_rollout import rollout_pb2 as pb
from ferrule_rollout.client import RolloutClient
from ferrule_testkit import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from rollout_helpers import LOGPROB_ATOL, free_port, hf_logprobs, in_thread, perturb_

TOKEN = "rollout-test-token-0123456789abcdef"
PROMPTS = ["Question: what is 12 + 30? Answer:", [5, 6, 7, 8]]
GREEDY = SamplingSettings(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def server(vllm_cpu_env, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    args = [sys.executable, "-m", "ferrule_rollout", "serve", "--model", str(tiny_model("qwen2"))]
    args += ["--bind", "127.0.0.1:0", "--dtype", "float32", "--max-model-len", "256"]
    args += ["--token-file", str(token_file)]
    # small limits, to reach them cheaply (defaults: 4096, 16384, 1 MiB)
    args += ["--max-request-sequences", "64", "--max-sequences-in-flight", "96"]
    args += ["--max-prompt-bytes", "4096"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the engine logs first; the ready line names the port
        lines.append(line)
        if line.startswith("rlhf-rollout: serving"):
            break
    else:
        pytest.fail("the server exited before serving:\n" + "".join(lines[-30:]))
    address = line.rsplit(" on ", 1)[1].strip()
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain
    yield address
    proc.terminate()
    assert proc.wait(60) == 0  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def client(server):
    with RolloutClient(server, timeout=120, token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32).eval()


def check_against(policy, samples):
    for sample in samples:
        expected, argmax = hf_logprobs(policy, sample.prompt_token_ids, sample.token_ids)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=LOGPROB_ATOL)
        assert sample.token_ids == argmax.tolist()


def test_generate_over_grpc_matches_transformers(client, policy):
    samples = client.generate(PROMPTS, GREEDY)
    assert [(s.prompt_index, len(s.token_ids), s.finish_reason) for s in samples] == [
        (0, 10, "length"),
        (1, 10, "length"),
    ]
    assert all(s.version == client.health()["version"] for s in samples)
    check_against(policy, samples)


def test_stream_returns_every_sample(client):
    settings = SamplingSettings(n=3, max_tokens=8, seed=3)
    samples = list(client.generate_stream(PROMPTS, settings))
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [
        (p, i) for p in range(2) for i in range(3)
    ]


def test_cancelling_a_stream_aborts_the_rest(client):
    stream = client.generate_stream(PROMPTS, SamplingSettings(n=16, max_tokens=240))
    next(stream)
    stream.close()  # cancels the call
    client.pause("keep")  # freeze: only an abort can empty the running set now
    try:
        deadline = time.monotonic() + 10
        while client.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.health()["running"] == 0
    finally:
        client.resume()


def raw_generate(server, prompts, timeout=60, **sampling):
    with grpc.insecure_channel(server) as channel:
        stub = pb_grpc().RolloutServiceStub(channel)
        request = pb.GenerateRequest(prompts=prompts, sampling=pb.SamplingSettings(**sampling))
        return stub.Generate(request, timeout=timeout, metadata=bearer(TOKEN))


def wait_until_idle(client, within: float = 10) -> int:
    deadline = time.monotonic() + within
    while client.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.health()["running"]


def test_a_unary_call_past_its_deadline_stops_its_samples(server, client):
    """They ran on: n = 1000 with a 2 s deadline, 360 of 1000 still running 40 s later."""
    prompt = [pb.Prompt(text="hi")]
    calling = in_thread(raw_generate, server, prompt, timeout=1.5, n=64, max_tokens=240)
    deadline = time.monotonic() + 1.0
    while not client.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    client.pause("keep")  # frozen: only an abort can empty the running set now
    try:
        with pytest.raises(grpc.RpcError) as caught:
            calling.get()
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until_idle(client) == 0 and client.health()["queued"] == 0
    finally:
        client.resume()


def test_too_many_sequences_or_too_long_a_prompt_is_refused_before_any_work(server, client):
    """n = 10**6 was admitted (291k sequences in 50 s); a 10 MiB prompt was tokenized whole."""
    for prompts, sampling, match in [
        ([pb.Prompt(text="hi")] * 2, {"n": 33}, "66 sequences, more than this server's "),
        ([pb.Prompt(text="hi")], {"n": 10**6}, "--max-request-sequences 64"),
        ([pb.Prompt(text="x" * 4097)], {}, "prompt 0 is 4097 bytes, more than"),
        ([pb.Prompt(text="hi"), pb.Prompt(text="é" * 4000)], {}, "prompt 1 is 8000 bytes"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            raw_generate(server, prompts, **sampling)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in caught.value.details()
        assert client.health()["running"] == 0
    assert len(client.generate(PROMPTS[:1], GREEDY)) == 1


def test_sequences_in_flight_are_bounded_and_freed_when_calls_end(server, client):
    stream = client.generate_stream(PROMPTS, SamplingSettings(n=32, max_tokens=240))
    next(stream)  # 64 in flight (one of them done)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            raw_generate(server, [pb.Prompt(text="hi")], n=40, max_tokens=4)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "64 sequences in flight and 40 asked for" in caught.value.details()
        assert len(raw_generate(server, [pb.Prompt(text="hi")], n=32, max_tokens=4).samples) == 32
    finally:
        stream.close()
    assert wait_until_idle(client) == 0
    assert len(raw_generate(server, [pb.Prompt(text="hi")], n=64, max_tokens=4).samples) == 64


def pb_grpc():
    from ferrule_rollout import rollout_pb2_grpc

    return rollout_pb2_grpc


@pytest.mark.parametrize(
    "prompts, sampling, match",
    [
        ([pb.Prompt(text="hi")], {"n": 0}, "n must be >= 1"),
        ([pb.Prompt(text="hi")], {"n": -2}, "n must be >= 1"),
        ([pb.Prompt(text="hi")], {"temperature": -1.0}, "temperature must be >= 0"),
        ([pb.Prompt(text="hi")], {"top_p": 0.0}, "top_p must be in"),
        ([pb.Prompt(text="hi")], {"top_k": -5}, "top_k must be"),
        ([pb.Prompt(text="hi")], {"max_tokens": 0}, "max_tokens must be >= 1"),
        ([pb.Prompt(text="x " * 400)], {}, "maximum length is 256"),
        ([pb.Prompt(token_ids=[1, 99_999])], {}, "outside the vocabulary"),
        ([pb.Prompt()], {}, "prompt 0 is empty"),
        ([pb.Prompt(text="a", token_ids=[1])], {}, "not both"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(
    server, client, prompts, sampling, match
):
    with pytest.raises(grpc.RpcError) as caught:
        raw_generate(server, prompts, **sampling)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in caught.value.details()
    assert client.health()["status"] == "serving"
    assert len(client.generate(PROMPTS[:1], GREEDY)) == 1


def test_update_without_a_group_is_failed_precondition(client):
    with pytest.raises(grpc.RpcError) as caught:
        client.update_weights()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "init_weight_sync" in caught.value.details()
    assert client.health()["status"] == "serving"


def test_pause_queues_requests_and_resume_serves_them(client):
    client.pause()
    assert client.health()["status"] == "paused"
    generating = in_thread(client.generate, PROMPTS, GREEDY)
    time.sleep(0.5)
    assert generating.thread.is_alive() and client.health()["queued"] == 2
    client.resume()
    assert len(generating.get()) == 2
    assert client.health()["status"] == "serving"


def test_without_the_token_nothing_is_served_and_nothing_changes(server, client):
    with RolloutClient(server, timeout=30) as stranger:
        for call in (stranger.health, stranger.pause, lambda: stranger.update_weights(timeout=1)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert client.health()["status"] == "serving"  # the stranger's pause did not happen


def test_generation_goes_on_while_a_join_waits_for_its_sender(server, client):
    """A join with no sender held the engine lock for weightsync's 900 s connect default:
    every Generate timed out meanwhile, whatever timeout_s said."""
    joining = in_thread(
        client.init_weight_sync, "ipc", "127.0.0.1", free_port(), rank=1, num_receivers=1,
        timeout=4,
    )  # fmt: skip
    time.sleep(0.5)
    reply = raw_generate(server, [pb.Prompt(text="hi")], timeout=3, max_tokens=4)
    assert len(reply.samples) == 1
    assert joining.thread.is_alive()  # still waiting for the sender
    with pytest.raises(grpc.RpcError) as caught:
        joining.get(30)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot reach the weight-sync group" in caught.value.details()
    assert client.health()["status"] == "serving"


def test_weight_update_over_grpc(client, policy):
    from ferrule_weightsync import create_sender

    port = free_port()
    secret = "weight-sync-secret-over-grpc-0123456789"  # the group is authenticated too
    joining = in_thread(create_sender, "ipc", "127.0.0.1", port, 1, timeout=60, secret=secret)
    client.init_weight_sync(
        "ipc", "127.0.0.1", port, rank=1, num_receivers=1, timeout=60, secret=secret
    )
    sender = joining.get()
    try:
        version = client.health()["version"]
        perturb_(policy, seed=5)
        sending = in_thread(sender.send, list(policy.named_parameters()), version=version + 1)
        busy = in_thread(client.generate, PROMPTS, SamplingSettings(n=4, max_tokens=32))
        assert client.update_weights(timeout=60) == version + 1 == sending.get()
        assert len(busy.get()) == 8  # requests in flight during the update all came back
    finally:
        sender.close()
    samples = client.generate(PROMPTS, GREEDY)
    assert all(s.version == version + 1 for s in samples)
    check_against(policy, samples)
    client.sleep()  # a logged no-op on CPU
    client.wake_up()
