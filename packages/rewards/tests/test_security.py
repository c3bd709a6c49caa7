"""Secure by default: loopback binding, the token on every call, TLS and mutual TLS."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from ferrule_grpc_auth import TLS, InsecureBindError
from ferrule_rewards.client import RewardClient, RewardError, RewardServersUnavailable

TOKEN = "s3cret-token-for-tests-0123456789"


def test_server_only_tls_beyond_loopback_is_refused_and_mutual_tls_is_not(serve, certs):
    tls = TLS(str(certs.server_cert), str(certs.server_key))
    with pytest.raises(InsecureBindError, match="TLS alone lets any client in"):
        serve(bind="0.0.0.0:0", tls=tls)
    mutual = TLS(str(certs.server_cert), str(certs.server_key), client_ca=str(certs.ca))
    server = serve(bind="0.0.0.0:0", tls=mutual)
    port = server.address.rsplit(":", 1)[1]
    with RewardClient(
        f"localhost:{port}",
        tls_ca=str(certs.ca),
        tls_cert=str(certs.client_cert),
        tls_key=str(certs.client_key),
    ) as client:
        assert client.score([{"response": "abc"}])[0].reward == 3.0
    with (
        RewardClient(f"localhost:{port}", tls_ca=str(certs.ca), retry_for=0.5, timeout=2) as c,
        pytest.raises(RewardServersUnavailable),
    ):
        c.score([{"response": "abc"}])  # TLS without a client certificate: not let in


def test_every_call_needs_the_token(serve, monkeypatch):
    monkeypatch.delenv("FERRULE_REWARDS_TOKEN", raising=False)
    server = serve(token=TOKEN)
    samples = [{"response": "abc"}]
    with RewardClient(server.address, token=TOKEN) as client:
        assert client.score(samples)[0].reward == 3.0
    for token, message in ((None, "missing token"), ("x" * 32, "wrong token")):
        with RewardClient(server.address, token=token) as client, pytest.raises(RewardError) as e:
            client.score(samples)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert message in str(e.value)
    with grpc.insecure_channel(server.address) as channel:
        # Reflection is guarded too (a streaming method: the refusal must match its shape) ...
        with pytest.raises(grpc.RpcError) as e:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # ... health checks are not: probes and load balancers cannot send the token.
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_the_client_reads_the_token_from_the_environment(serve, monkeypatch):
    server = serve(token=TOKEN)
    monkeypatch.setenv("FERRULE_REWARDS_TOKEN", TOKEN)
    with RewardClient(server.address) as client:
        assert client.score([{"response": "ab"}])[0].reward == 2.0


def test_tls(serve, certs):
    server = serve(tls=TLS(str(certs.server_cert), str(certs.server_key)))
    with RewardClient(server.address, tls_ca=str(certs.ca)) as client:
        assert client.score([{"response": "abc"}])[0].reward == 3.0
    # A plaintext client cannot talk to a TLS server (it retries, then says so).
    with (
        RewardClient(server.address, retry_for=0.5, timeout=2) as client,
        pytest.raises(RewardServersUnavailable, match=server.address),
    ):
        client.score([{"response": "abc"}])
    # Nor can a client that does not trust the server's CA (system roots only here).
    with (
        RewardClient(server.address, tls=True, retry_for=0.5, timeout=2) as client,
        pytest.raises(RewardServersUnavailable),
    ):
        client.score([{"response": "abc"}])


def test_mutual_tls_with_a_token(serve, certs):
    tls = TLS(str(certs.server_cert), str(certs.server_key), client_ca=str(certs.ca))
    server = serve(tls=tls, token=TOKEN)
    trusted = dict(tls_ca=str(certs.ca), tls_cert=str(certs.client_cert))
    with RewardClient(
        server.address, token=TOKEN, tls_key=str(certs.client_key), **trusted
    ) as client:
        assert client.score([{"response": "abc"}])[0].reward == 3.0
    refused = {
        "no client certificate": dict(tls_ca=str(certs.ca)),
        "certificate from another CA": dict(
            tls_ca=str(certs.ca), tls_cert=str(certs.rogue_cert), tls_key=str(certs.rogue_key)
        ),
    }
    for name, options in refused.items():
        with (
            RewardClient(
                server.address, token=TOKEN, retry_for=0.5, timeout=2, **options
            ) as client,
            pytest.raises(RewardServersUnavailable),
        ):
            client.score([{"response": "abc"}])
            pytest.fail(f"{name}: the server took the call")


def test_client_tls_options_must_pair():
    with pytest.raises(ValueError, match="both a certificate and its key"):
        RewardClient("127.0.0.1:1", tls_cert="client.pem")
