"""Where a server may listen: loopback, unless its clients must authenticate."""

import ipaddress
import socket


class InsecureBindError(ValueError):
    """The server was asked to listen beyond this machine without client authentication."""


def split_address(address: str) -> tuple[str, int]:
    """Split `host:port` or `[v6]:port` into (host, port); raise ValueError naming the address
    otherwise."""
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


def check_bind(address: str, *, token: str | None, client_auth: bool, token_env: str) -> None:
    """Refuse a non-loopback listening address when clients need not authenticate, that is,
    when there is neither a token nor mutual TLS (`client_auth`). TLS alone encrypts but lets
    any client in.
    `token_env` is the variable the error tells the user to set."""
    if address.startswith("unix:"):  # a local socket; file permissions guard it
        return
    host, _ = split_address(address)
    if is_loopback(host) or token or client_auth:
        return
    raise InsecureBindError(
        f"refusing to listen on {address}: it is reachable from other machines and clients "
        f"need not authenticate. Set a token ({token_env} or --token-file) or mutual TLS "
        "(--tls-client-ca with --tls-cert/--tls-key; TLS alone lets any client in), or bind "
        "to 127.0.0.1"
    )
