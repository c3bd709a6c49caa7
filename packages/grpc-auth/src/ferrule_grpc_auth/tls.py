"""TLS credentials for servers and clients, read from PEM files with errors that name them."""

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLS:
    cert: str
    key: str
    client_ca: str | None = None
    """A CA certificate file. When it is set, clients must present a certificate signed by
    this CA (mutual TLS)."""

    def server_credentials(self) -> grpc.ServerCredentials:
        return server_credentials(self.cert, self.key, self.client_ca)


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {what}: {error}") from None


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None):
    """TLS for a server; with `client_ca`, mutual TLS: clients must show a certificate
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
