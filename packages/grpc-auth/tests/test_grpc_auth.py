"""ferrule-grpc-auth: where a server may listen, tokens, and the interceptors on real servers
(thread-pool and asyncio) on loopback."""

import asyncio
import re
import threading
from concurrent import futures

import grpc
import pytest

from ferrule_grpc_auth import (
    InsecureBindError,
    SyncTokenInterceptor,
    TokenInterceptor,
    bearer,
    check_bind,
    is_loopback,
    read_token,
    split_address,
)

TOKEN = "s3cret-token-for-tests-0123456789"
ENV = "FERRULE_TEST_TOKEN"
MAX_MESSAGE = 1 << 20


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.0.2.7", False),
        ("no-such-host.invalid", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_split_address():
    assert split_address("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert split_address("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError, match="expected host:port"):
        split_address("localhost")
    with pytest.raises(ValueError, match="expected host:port"):
        split_address("127.0.0.1:70000")


def test_non_loopback_needs_a_token_or_mutual_tls():
    """Server-only TLS encrypts but lets any client in: it does not count."""
    check_bind("127.0.0.1:50051", token=None, client_auth=False, token_env=ENV)
    check_bind("unix:/tmp/rewards.sock", token=None, client_auth=False, token_env=ENV)
    for address in ("0.0.0.0:50051", "[::]:50051", "192.0.2.7:50051"):
        with pytest.raises(InsecureBindError, match=f"clients need not authenticate.*{ENV}"):
            check_bind(address, token=None, client_auth=False, token_env=ENV)
        check_bind(address, token=TOKEN, client_auth=False, token_env=ENV)
        check_bind(address, token=None, client_auth=True, token_env=ENV)


def test_tokens_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert read_token(None, ENV) is None
    monkeypatch.setenv(ENV, TOKEN)
    assert read_token(None, ENV) == TOKEN
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert read_token(tmp_path / "token", ENV) == TOKEN
    (tmp_path / "short").write_text("hunter2")
    with pytest.raises(ValueError, match="7 characters; use at least 16"):
        read_token(tmp_path / "short", ENV)
    with pytest.raises(ValueError, match="cannot read token file"):
        read_token(tmp_path / "missing", ENV)


@pytest.mark.parametrize(
    ("token", "bad"),
    [("é" * 20, "'é' at position 0"), ("abcdefgh\nijklmnopq", "'\\n' at position 8"),
     ("abcdefgh ijklmnopq", "' ' at position 8"), ("abcdefghijklmnop\x00", "'\\x00' at position 16")],
)  # fmt: skip
def test_a_token_no_client_can_send_is_refused(tmp_path, token, bad):
    (tmp_path / "token").write_text(token)
    with pytest.raises(ValueError, match=f"holds {re.escape(bad)}.*printable ASCII"):
        read_token(tmp_path / "token", ENV)


# A service of two methods, bytes in and out, plus one the server exempts from the token.
def _echo(request, context):
    return request[:16]


def _chunks(request, context):
    yield from (request[:4], request[4:8])


def _ping(request, context):
    return b"pong"


async def _echo_async(request, context):
    return request[:16]


async def _chunks_async(request, context):
    for part in (request[:4], request[4:8]):
        yield part


async def _ping_async(request, context):
    return b"pong"


def _handlers(echo, chunks, ping):
    return [
        grpc.method_handlers_generic_handler(
            "test.Echo",
            {
                "Echo": grpc.unary_unary_rpc_method_handler(echo),
                "Chunks": grpc.unary_stream_rpc_method_handler(chunks),
            },
        ),
        grpc.method_handlers_generic_handler(
            "test.Probe", {"Ping": grpc.unary_unary_rpc_method_handler(ping)}
        ),
    ]


OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE)]


@pytest.fixture
def sync_server():
    server = grpc.server(
        futures.ThreadPoolExecutor(4),
        interceptors=[SyncTokenInterceptor(TOKEN, exempt=("/test.Probe/",))],
        handlers=_handlers(_echo, _chunks, _ping),
        options=OPTIONS,
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture
def async_server():
    started, stop = threading.Event(), threading.Event()
    address = []

    async def run():
        server = grpc.aio.server(
            interceptors=[TokenInterceptor(TOKEN, exempt=("/test.Probe/",))],
            handlers=_handlers(_echo_async, _chunks_async, _ping_async),
            options=OPTIONS,
        )
        address.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield address[0]
    stop.set()
    thread.join(10)


@pytest.fixture(params=["sync_server", "async_server"])
def address(request):
    return request.getfixturevalue(request.param)


def _calls(address):
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    return (
        channel,
        channel.unary_unary("/test.Echo/Echo"),
        channel.unary_stream("/test.Echo/Chunks"),
        channel.unary_unary("/test.Probe/Ping"),
    )


def test_every_call_needs_the_token_but_exempt_ones(address):
    channel, echo, chunks, ping = _calls(address)
    with channel:
        assert echo(b"hello", metadata=bearer(TOKEN), timeout=5) == b"hello"
        assert list(chunks(b"abcdefgh", metadata=bearer(TOKEN), timeout=5)) == [b"abcd", b"efgh"]
        assert ping(b"", timeout=5) == b"pong"
        for metadata, why in ((None, "missing token"), (bearer(TOKEN + "x"), "wrong token")):
            for call in (lambda m: echo(b"hi", metadata=m, timeout=5),
                         lambda m: list(chunks(b"abcdefgh", metadata=m, timeout=5))):  # fmt: skip
                with pytest.raises(grpc.RpcError) as denied:
                    call(metadata)
                assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert why in denied.value.details()


def test_a_refused_call_is_not_read(address):
    """A stranger's request larger than the server accepts is refused for its token, not its
    size: the server never read it. With the token, the size limit answers."""
    channel, echo, _, _ = _calls(address)
    big = b"x" * (2 * MAX_MESSAGE)
    with channel:
        with pytest.raises(grpc.RpcError) as denied:
            echo(big, metadata=bearer("not-the-token-0123456789"), timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as too_big:
            echo(big, metadata=bearer(TOKEN), timeout=10)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert echo(b"still serving", metadata=bearer(TOKEN), timeout=5) == b"still serving"
