"""Secure by default: where the server may listen, the bearer token, and TLS credentials.

    check_bind("0.0.0.0:50051", token=None, client_auth=False)   # raises InsecureBindError
    server = grpc.aio.server(interceptors=[TokenInterceptor(token)])

The server binds to loopback unless told otherwise, and refuses any other address unless
clients must authenticate: with a token, or with mutual TLS (a client certificate). TLS alone
encrypts but lets any client in, so it does not count. The token travels as `authorization: Bearer <token>` metadata and is
checked on every call except health checks (load balancers and Kubernetes probes cannot send
it, and the answer reveals only SERVING or NOT_SERVING). Tokens come from a file or the
FERRULE_REWARDS_TOKEN environment variable, never the command line, where `ps` would show them.
"""

import hmac
import ipaddress
import os
import socket
from pathlib import Path

import grpc

TOKEN_ENV = "FERRULE_REWARDS_TOKEN"
MIN_TOKEN_CHARS = 16
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class InsecureBindError(ValueError):
    """The server was asked to listen beyond this machine without client authentication."""


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` as (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r}: expected host:port, e.g. 127.0.0.1:50051")
    return host.removeprefix("[").removesuffix("]"), int(port)


def is_loopback(host: str) -> bool:
    """True when every address `host` names is on this machine's loopback interface."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host in ("", "*"):  # all interfaces
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_bind(address: str, *, token: str | None, client_auth: bool) -> None:
    """Refuse a non-loopback listening address where clients need not authenticate: neither a
    token nor mutual TLS (`client_auth`)."""
    if address.startswith("unix:"):  # a local socket; file permissions guard it
        return
    host, _ = split_address(address)
    if is_loopback(host) or token or client_auth:
        return
    raise InsecureBindError(
        f"refusing to listen on {address}: it is reachable from other machines and clients "
        f"need not authenticate. Set a token ({TOKEN_ENV} or --token-file) or mutual TLS "
        "(--tls-client-ca with --tls-cert/--tls-key; TLS alone lets any client in), or bind "
        "to 127.0.0.1"
    )


def check_token(token: str, source: str) -> str:
    """The token, stripped; ValueError when it is short, or holds a character that no client
    can send in a gRPC header (non-ASCII, a space or a control character inside it)."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"token from {source} is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(for example `openssl rand -hex 32`)"
        )
    bad = next((c for c in token if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ValueError(
            f"token from {source} holds {bad!r} at position {token.index(bad)}: a token is "
            "printable ASCII without spaces (clients send it as a header)"
        )
    return token


def read_token(token_file: str | Path | None) -> str | None:
    """The server's token: from `token_file` when given, else from $FERRULE_REWARDS_TOKEN."""
    if token_file:
        try:
            return check_token(Path(token_file).read_text(), str(token_file))
        except OSError as error:
            raise ValueError(f"cannot read token file: {error}") from None
    if os.environ.get(TOKEN_ENV):
        return check_token(os.environ[TOKEN_ENV], f"${TOKEN_ENV}")
    return None


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler that fails the call with UNAUTHENTICATED without reading its request: a
    client-streaming one, because gRPC reads a unary request whole before calling its handler
    (a stranger could make the server buffer --max-message-mb per call). On the wire, a
    client-streaming call and a unary one look the same."""

    async def deny(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    return grpc.stream_unary_rpc_method_handler(deny)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` on every call but health checks."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        metadata = details.invocation_metadata or ()
        sent = next((value for key, value in metadata if key == "authorization"), None)
        if sent is None:
            return _denied(handler, "missing token: send `authorization: Bearer <token>` metadata")
        sent = sent.encode() if isinstance(sent, str) else sent
        # Constant-time comparison, so the answer's timing does not leak the token.
        if not hmac.compare_digest(sent, self._expected):
            return _denied(handler, "wrong token")
        return handler


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {what}: {error}") from None


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None):
    """TLS for the server; with `client_ca`, mutual TLS: clients must show a certificate
    signed by that CA."""
    return grpc.ssl_server_credentials(
        [(_read(key, "TLS key"), _read(cert, "TLS certificate"))],
        root_certificates=_read(client_ca, "client CA"),
        require_client_auth=client_ca is not None,
    )


def channel_credentials(ca=None, cert=None, key=None):
    """TLS for a client: `ca` verifies the server (default: the system's roots); `cert` and
    `key` are the client's own certificate, for servers that require mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("client TLS: give both a certificate and its key, or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "TLS CA"),
        private_key=_read(key, "client TLS key"),
        certificate_chain=_read(cert, "client TLS certificate"),
    )
