"""Secure-by-default gRPC servers, for Ferrule's reward and rollout servers and yours.

    check_bind(bind, token=token, client_auth=tls is not None and tls.client_ca is not None,
               token_env="MY_TOKEN")          # raises InsecureBindError beyond loopback
    server = grpc.server(pool, interceptors=[SyncTokenInterceptor(token)])
    port = server.add_secure_port(bind, tls.server_credentials())
    # A grpc.aio server takes TokenInterceptor instead of SyncTokenInterceptor.

A server binds to loopback unless told otherwise. It refuses any other address unless
clients must authenticate, with a token or with mutual TLS. The token is checked on every
call before the call's request is read, except on the methods that a server exempts, such as
the standard health checks.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from ferrule_grpc_auth.addresses import InsecureBindError, check_bind, is_loopback, split_address
from ferrule_grpc_auth.options import (
    add_client_options,
    add_server_options,
    client_security,
    server_security,
)
from ferrule_grpc_auth.tls import TLS, channel_credentials, server_credentials
from ferrule_grpc_auth.tokens import (
    MIN_TOKEN_CHARS,
    SyncTokenInterceptor,
    TokenInterceptor,
    bearer,
    check_token,
    read_token,
)

try:
    __version__ = _version("ferrule-grpc-auth")
except PackageNotFoundError:  # the package was copied into another project's tree
    __version__ = "0+source"

__all__ = [
    "MIN_TOKEN_CHARS",
    "TLS",
    "InsecureBindError",
    "SyncTokenInterceptor",
    "TokenInterceptor",
    "add_client_options",
    "add_server_options",
    "bearer",
    "channel_credentials",
    "check_bind",
    "check_token",
    "client_security",
    "is_loopback",
    "read_token",
    "server_credentials",
    "server_security",
    "split_address",
]
