"""`rlhf-rollout serve` stays answerable whatever its calls wait for (issue 58): a weight-sync
join with no sender ends within its `timeout_s`, is given up when its client leaves, and does
not hold SIGTERM; generation queued behind a pause never takes the threads that health and
Resume need; a token-id prompt longer than the model is refused before it is converted. The
real CLI with the transformers engine (it starts in seconds), one server per test."""

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from ferrule_grpc_auth import bearer
from ferrule_rollout import BadRequestError, rollout_pb2_grpc
from ferrule_rollout import rollout_pb2 as pb
from ferrule_rollout.client import RolloutClient
from ferrule_rollout.server import prompts_from_proto

sys.path.insert(0, str(Path(__file__).parent))
from rollout_helpers import free_port, in_thread, start_transformers_server

TOKEN = "rollout-liveness-token-0123456789"
GRACE = 5.0  # rlhf-rollout serve's for calls other than generation


def start():
    process, address = start_transformers_server(
        "--bind", "127.0.0.1:0", env={"FERRULE_ROLLOUT_TOKEN": TOKEN}
    )
    return SimpleNamespace(process=process, address=address)


def stop(server) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()


@pytest.fixture(scope="module")
def shared():
    """One server for the tests that leave it serving."""
    server = start()
    yield server
    stop(server)


@pytest.fixture
def own():
    """A server of the test's own, for the tests that stop it."""
    server = start()
    yield server
    stop(server)


def stub_of(server):
    return rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(server.address))


def join(stub, port: int, *, timeout_s: float, deadline: float):
    request = pb.InitWeightSyncRequest(
        transport="ipc", host="127.0.0.1", port=port, rank=1, num_receivers=1, timeout_s=timeout_s
    )
    return stub.InitWeightSync(request, timeout=deadline, metadata=bearer(TOKEN))


@pytest.mark.e2e  # a server of its own or a shared one, ~5-15 s
def test_a_join_with_no_sender_ends_within_its_timeout(shared):
    """It waited weightsync's 900 s connect default whatever timeout_s said."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        join(stub_of(shared), free_port(), timeout_s=2, deadline=20)
    took = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot reach the weight-sync group" in caught.value.details()
    assert took < 10, took


@pytest.mark.e2e  # a server of its own or a shared one, ~5-15 s
def test_a_join_whose_client_left_is_given_up(shared):
    """Joins run one at a time, so the next one succeeds only once the server stopped
    waiting on behalf of the client that left (it used to wait on for up to 900 s)."""
    with pytest.raises(grpc.RpcError) as caught:
        join(stub_of(shared), free_port(), timeout_s=120, deadline=1)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    from ferrule_weightsync import create_sender

    port = free_port()
    joining = in_thread(create_sender, "ipc", "127.0.0.1", port, 1, timeout=30)
    with RolloutClient(shared.address, timeout=10, token=TOKEN) as client:
        client.init_weight_sync("ipc", "127.0.0.1", port, rank=1, num_receivers=1, timeout=30)
    joining.get(30).close(timeout=0)


@pytest.mark.e2e  # a server of its own or a shared one, ~5-15 s
def test_sigterm_exits_within_its_grace_while_a_join_waits(own):
    """SIGTERM logged "shutting down" and the process was still there 28 s later. The join
    gets the grace as other calls do; the interpreter's exit takes ~2 s more here."""
    calling = in_thread(join, stub_of(own), free_port(), timeout_s=120, deadline=120)
    time.sleep(1.0)
    own.process.terminate()
    assert own.process.wait(GRACE + 5) == 0
    with pytest.raises(grpc.RpcError) as caught:
        calling.get(10)
    assert caught.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


@pytest.mark.e2e  # a server of its own or a shared one, ~5-15 s
def test_health_and_resume_answer_while_paused_generation_fills_the_pool():
    """66 Generates queued behind a pause took all 64 handler threads: Health and Resume then
    waited for them (a deadlock without client deadlines)."""
    process, address = start_transformers_server(
        "--bind", "127.0.0.1:0", "--max-workers", "12", env={"FERRULE_ROLLOUT_TOKEN": TOKEN}
    )
    try:
        with (
            RolloutClient(address, timeout=3, token=TOKEN) as control,
            grpc.insecure_channel(address) as channel,
        ):
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            request = pb.GenerateRequest(
                prompts=[pb.Prompt(text="hi")], sampling=pb.SamplingSettings(max_tokens=2)
            )
            control.pause()
            calls = [
                in_thread(stub.Generate, request, timeout=30, metadata=bearer(TOKEN))
                for _ in range(16)  # more than the pool's 12 threads
            ]
            time.sleep(1.0)
            assert control.health()["status"] == "paused"  # within the 3 s deadline
            control.resume()
            served = refused = 0
            for call in calls:
                try:
                    served += len(call.get(30).samples)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "4 generation calls in flight" in error.details()
                    refused += 1
            assert (served, refused) == (4, 12)  # 12 threads less the 8 kept for control
    finally:
        process.terminate()
        process.wait(30)


def test_too_long_a_token_id_prompt_is_refused_before_it_is_converted():
    """10^8 ids were made a Python list first: refused after 18 s, +2.5 GB."""

    class Ids:  # a prompt's token ids that must not be read
        def __len__(self):
            return 10**8

        def __iter__(self):
            raise AssertionError("the ids were converted before the length check")

    prompt = SimpleNamespace(text="", token_ids=Ids())
    with pytest.raises(BadRequestError, match="prompt 0 is 100000000 tokens long; the model's"):
        prompts_from_proto([prompt], max_prompt_bytes=1 << 20, max_model_len=128)


@pytest.mark.e2e  # a server of its own or a shared one, ~5-15 s
def test_a_huge_token_id_prompt_is_refused_at_once_over_grpc(shared):
    stub = stub_of(shared)
    """2 * 10^7 ids (20 MB on the wire): refused after 8 s before, 1.5 s now on this loaded
    2-core machine (most of it gRPC receiving and parsing the message)."""
    request = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=[5] * (2 * 10**7))])
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request, timeout=30, metadata=bearer(TOKEN))
    took = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt 0 is 20000000 tokens long; the model's maximum length is 128" in (
        caught.value.details()
    )
    assert took < 4.0, took
    health = stub.Health(pb.HealthRequest(), timeout=5, metadata=bearer(TOKEN))
    assert health.status == pb.HealthResponse.SERVING
