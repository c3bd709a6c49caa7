"""The security options every Ferrule server and client CLI takes, and what they mean.

add_server_options(parser, token_env="FERRULE_ROLLOUT_TOKEN")
token, tls = server_security(args, token_env="FERRULE_ROLLOUT_TOKEN")   # ValueError if bad
"""

import argparse
import logging

from ferrule_grpc_auth.tls import TLS
from ferrule_grpc_auth.tokens import read_token


def add_server_options(parser: argparse.ArgumentParser, *, token_env: str) -> None:
    add = parser.add_argument
    add("--token-file", help=f"file holding the bearer token clients must send (or ${token_env})")
    add("--tls-cert", help="server certificate (PEM); enables TLS, with --tls-key")
    add("--tls-key", help="server private key (PEM)")
    add("--tls-client-ca", help="CA (PEM) that signs client certificates: mutual TLS")


def server_security(args: argparse.Namespace, *, token_env: str) -> tuple[str | None, TLS | None]:
    """Return (token, TLS) from the options of add_server_options. A bad option raises
    ValueError naming it."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    token = read_token(args.token_file, token_env)
    tls = TLS(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    if token and not tls:
        logging.getLogger(__name__).warning(
            "a token without TLS crosses the network in clear text; add --tls-cert/--tls-key"
        )
    return token, tls


def add_client_options(parser: argparse.ArgumentParser, *, token_env: str) -> None:
    add = parser.add_argument
    add("--token-file", help=f"file holding the bearer token (or ${token_env})")
    add("--tls-ca", help="CA (PEM) to verify the server; enables TLS")
    add("--tls-cert", help="client certificate (PEM), for mutual TLS")
    add("--tls-key", help="client private key (PEM), for mutual TLS")
    add(
        "--tls-server-name",
        help="the name the server's certificate carries, when not the address's host "
        "(a health check on 127.0.0.1 of a server whose certificate names its DNS name)",
    )


def client_security(args: argparse.Namespace, *, token_env: str) -> dict:
    """The keyword arguments of a Ferrule client (token, tls_ca, tls_cert, tls_key,
    tls_server_name) from the options of add_client_options."""
    return {
        "token": read_token(args.token_file, token_env),
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_server_name": args.tls_server_name,
    }
