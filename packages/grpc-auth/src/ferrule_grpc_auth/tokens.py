"""Bearer tokens: reading them, and checking them on every call before its request is read.

The token travels as `authorization: Bearer <token>` metadata. It comes from a file or an
environment variable, never the command line, where `ps` would show it.
"""

import hmac
import os
from pathlib import Path

import grpc

MIN_TOKEN_CHARS = 16


def check_token(token: str, source: str) -> str:
    """Return the token, stripped. Raise ValueError when it is too short, or when it holds a
    character that no client can send in a gRPC header (non-ASCII, a space or a control
    character inside it)."""
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


def read_token(token_file: str | Path | None, env: str) -> str | None:
    """The token of a server or a client: read from `token_file` when given, else from the
    environment variable `env`. None when neither gives one."""
    if token_file:
        try:
            return check_token(Path(token_file).read_text(), str(token_file))
        except OSError as error:
            raise ValueError(f"cannot read token file: {error}") from None
    if os.environ.get(env):
        return check_token(os.environ[env], f"${env}")
    return None


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries `token` (None without one)."""
    return (("authorization", f"Bearer {token.strip()}"),) if token else None


def _refusal(expected: bytes, exempt: tuple[str, ...], details) -> str | None:
    """Why a call may not go on (None: it may)."""
    if details.method.startswith(exempt):
        return None
    sent = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
    if sent is None:
        return "missing token: send `authorization: Bearer <token>` metadata"
    sent = sent.encode() if isinstance(sent, str) else sent
    # Constant-time comparison, so the answer's timing does not leak the token.
    return None if hmac.compare_digest(sent, expected) else "wrong token"


# A refused call gets a client-streaming handler that aborts without reading the request:
# gRPC reads a unary request whole before calling its handler, so a stranger could otherwise
# make the server buffer a full message per call. On the wire, a client-streaming call and a
# unary one look the same.


def _denied_async(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    return grpc.stream_unary_rpc_method_handler(deny)


def _denied_sync(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def deny(requests, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def deny_stream(requests, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this a generator, as streaming handlers are

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    return grpc.stream_unary_rpc_method_handler(deny)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """For grpc.aio servers: checks the token on every call except those whose method starts
    with one of `exempt` (e.g. "/grpc.health.v1.Health/", because probes cannot send a token)."""

    def __init__(self, token: str, exempt: tuple[str, ...] = ()):
        self._expected, self._exempt = f"Bearer {token}".encode(), tuple(exempt)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        refusal = handler and _refusal(self._expected, self._exempt, details)
        return _denied_async(handler, refusal) if refusal else handler


class SyncTokenInterceptor(grpc.ServerInterceptor):
    """TokenInterceptor for thread-pool (grpc.server) servers."""

    def __init__(self, token: str, exempt: tuple[str, ...] = ()):
        self._expected, self._exempt = f"Bearer {token}".encode(), tuple(exempt)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        refusal = handler and _refusal(self._expected, self._exempt, details)
        return _denied_sync(handler, refusal) if refusal else handler
