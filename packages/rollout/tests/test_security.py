"""`rlhf-rollout serve` is secure by default, as the reward server is: loopback unless clients
authenticate, the token on every call (weight sync, pause / resume and health included), TLS
and mutual TLS. The real CLI in its own process, with the transformers engine (it starts in
seconds; the vLLM server's token path is test_server.py's)."""

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from ferrule_grpc_auth import bearer
from ferrule_rollout import SamplingSettings, rollout_pb2_grpc
from ferrule_rollout import rollout_pb2 as pb
from ferrule_rollout.client import RolloutClient
from ferrule_rollout.server import MAX_MESSAGE_BYTES
from ferrule_testkit.certs import make_certs

sys.path.insert(0, str(Path(__file__).parent))
from rollout_helpers import free_port
from rollout_helpers import start_transformers_server as start

TOKEN = "rollout-security-token-0123456789"
GREEDY = SamplingSettings(temperature=0.0, max_tokens=4, ignore_eos=True)
# Every method of the service with a harmless request: each must be refused without the token.
CALLS = {
    "Generate": pb.GenerateRequest(prompts=[pb.Prompt(text="hi")]),
    "GenerateStream": pb.GenerateRequest(prompts=[pb.Prompt(text="hi")]),
    "InitWeightSync": pb.InitWeightSyncRequest(
        transport="ipc", host="127.0.0.1", port=1, rank=1, num_receivers=1, timeout_s=1
    ),
    "UpdateWeights": pb.UpdateWeightsRequest(pause_mode="wait", timeout_s=1),
    "Pause": pb.PauseRequest(mode="wait"),
    "Resume": pb.ResumeRequest(),
    "Sleep": pb.SleepRequest(level=1),
    "WakeUp": pb.WakeUpRequest(),
    "Health": pb.HealthRequest(),
}


def test_every_method_of_the_service_is_covered():
    methods = pb.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name
    assert set(methods) == set(CALLS)


@pytest.fixture
def stop():
    processes = []
    yield processes.append
    for process in processes:
        process.terminate()
        assert process.wait(30) == 0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.mark.parametrize(
    ("bind", "extra"),
    [("0.0.0.0:0", []), ("[::]:0", []), ("0.0.0.0:0", ["tls"])],
)
def test_beyond_loopback_without_client_authentication_is_refused_before_the_model_loads(
    bind, extra, certs
):
    options = ["--bind", bind]
    if extra:  # server-only TLS encrypts but lets anyone in
        options += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    command = [sys.executable, "-m", "ferrule_rollout", "serve", "--model", "/no/such/model"]
    done = subprocess.run([*command, *options], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"refusing to listen on {bind}" in done.stderr
    assert "FERRULE_ROLLOUT_TOKEN" in done.stderr
    assert "does not exist" not in done.stderr  # refused before the model was looked at


def test_bad_security_options_are_named(tmp_path):
    command = [sys.executable, "-m", "ferrule_rollout", "serve", "--model", "/no/such/model"]
    (tmp_path / "short").write_text("hunter2")
    for options, message in (
        (["--token-file", str(tmp_path / "short")], "use at least 16"),
        (["--token-file", str(tmp_path / "missing")], "cannot read token file"),
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca (mutual TLS) needs --tls-cert"),
    ):
        done = subprocess.run([*command, *options], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, options
        assert message in done.stderr, done.stderr


@pytest.mark.e2e  # ~5-10 s of subprocesses (the fast tier stays under 10 minutes)
def test_every_call_needs_the_token_and_a_refused_one_does_nothing(stop):
    process, address = start(
        "--bind", "0.0.0.0:0", env={"FERRULE_ROLLOUT_TOKEN": TOKEN}
    )  # fmt: skip
    stop(process)
    address = f"127.0.0.1:{address.rsplit(':', 1)[1]}"
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for name, request in CALLS.items():
            wrong = [("authorization", "Bearer " + "x" * 32)]
            for metadata, why in ((None, "missing token"), (wrong, "wrong token")):
                with pytest.raises(grpc.RpcError) as refused:
                    response = getattr(stub, name)(request, timeout=10, metadata=metadata)
                    if name == "GenerateStream":
                        list(response)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert why in refused.value.details(), name
    with RolloutClient(address, timeout=60, token=TOKEN) as client:
        health = client.health()
        assert health["status"] == "serving"  # the refused Pause and Sleep did nothing
        assert health["version"] == 0  # nor did the refused weight update
        assert len(client.generate(["2 + 2 ="], GREEDY)) == 1
        client.pause()
        client.resume()
    with RolloutClient(address, timeout=60, token=TOKEN[:-1] + "X") as wrong:
        with pytest.raises(grpc.RpcError) as refused:
            wrong.generate(["2 + 2 ="], GREEDY)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "wrong token" in refused.value.details()


@pytest.mark.e2e  # a server of its own and a 10 s wait
def test_a_refused_call_is_not_read(stop):
    """A stranger's request over the server's size limit is refused for its token, not its
    size: the server never read it. With the token, the size limit answers."""
    port = free_port()
    process, address = start("--bind", f"127.0.0.1:{port}", env={"FERRULE_ROLLOUT_TOKEN": TOKEN})
    stop(process)
    big = pb.GenerateRequest(prompts=[pb.Prompt(text="x" * (MAX_MESSAGE_BYTES + (1 << 20)))])
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for metadata, code in ((None, "UNAUTHENTICATED"), (bearer(TOKEN), "RESOURCE_EXHAUSTED")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(big, timeout=60, metadata=metadata)
            assert refused.value.code() == getattr(grpc.StatusCode, code)
        health = stub.Health(pb.HealthRequest(), timeout=10, metadata=bearer(TOKEN))
        assert health.status == pb.HealthResponse.SERVING


@pytest.mark.e2e  # ~9 s: servers of their own
def test_tls_and_mutual_tls_with_a_token(stop, certs):
    tls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    process, address = start(
        "--bind", "0.0.0.0:0", *tls, "--tls-client-ca", str(certs.ca),
        env={"FERRULE_ROLLOUT_TOKEN": TOKEN},
    )  # fmt: skip
    stop(process)
    address = f"127.0.0.1:{address.rsplit(':', 1)[1]}"
    mine = {"tls_ca": str(certs.ca), "tls_cert": str(certs.client_cert)}
    mine["tls_key"] = str(certs.client_key)
    with RolloutClient(address, timeout=60, token=TOKEN, **mine) as client:
        assert client.health()["status"] == "serving"
        assert len(client.generate(["2 + 2 ="], GREEDY)) == 1
    rogue = {"tls_ca": str(certs.ca), "tls_cert": str(certs.rogue_cert)}
    rogue["tls_key"] = str(certs.rogue_key)
    for name, options in (
        ("no client certificate", {"tls_ca": str(certs.ca)}),
        ("a certificate of another CA", rogue),
        ("plaintext", {}),
    ):
        with RolloutClient(address, timeout=5, token=TOKEN, **options) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.health()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name
