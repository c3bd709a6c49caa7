"""A bound on each peer's connections, in front of the gRPC server.

    front = await Front.open("0.0.0.0", 50051, backend_path, per_peer=64, total=4096)
    ...; front.close()

gRPC Python bounds only the total number of connections
(`grpc.max_allowed_incoming_connections`), so one peer holding 4096 idle connections would shut
every other client out. With a TCP bind and a per-peer bound, gRPC listens on a Unix socket in
a private directory instead, and the front accepts on the public address. A connection past
`per_peer` from one peer, or past `total` in all, is reset at once, before any of its bytes is
read. An IPv6 peer counts by its /64, which one host usually holds whole. Every other
connection is relayed byte for byte to gRPC, which still does the TLS, HTTP/2, token and
limits end to end. The front decodes nothing.
"""

import asyncio
import ipaddress
import logging
import socket
import time
from collections import Counter

log = logging.getLogger(__name__)
HIGH_WATER = 256 << 10
"""Bytes that may wait to be written to one end of a relayed connection before the front stops
reading the other end. So a peer that does not read its answers holds at most this much memory
in the front."""
WARN_EVERY = 10.0  # seconds between log lines about one refused peer


def peer_key(address: str) -> str:
    """What one peer's connections are counted under: its IPv4 address, or its IPv6 /64."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv4Address):
        return str(ip)
    if ip.ipv4_mapped is not None:  # an IPv4 client of a dual-stack socket
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))


class _Side(asyncio.Protocol):
    """One end of a relayed connection. What it receives is written to the other end, and it
    stops reading while the writes of the other end are backed up. Every call on the other end
    first checks that the other end is still open: uvloop (which Ray's actors run) raises where
    asyncio's own loop ignores the call."""

    def __init__(self, other: "_Side | None" = None):
        self.transport: asyncio.Transport | None = None
        self.other = other

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def _other_open(self) -> asyncio.Transport | None:
        other = self.other.transport if self.other is not None else None
        return other if other is not None and not other.is_closing() else None

    def data_received(self, data: bytes) -> None:
        if other := self._other_open():
            other.write(data)

    def eof_received(self) -> bool:
        return False  # close this end; connection_lost closes the other end once it flushed

    def pause_writing(self) -> None:
        if other := self._other_open():
            other.pause_reading()

    def resume_writing(self) -> None:
        if other := self._other_open():
            other.resume_reading()

    def connection_lost(self, exc) -> None:
        if other := self._other_open():
            other.close()


class Front:
    """Listening sockets on the public address, relaying to gRPC's Unix socket."""

    def __init__(self, backend_path: str, per_peer: int, total: int):
        self.backend_path, self.per_peer, self.total = backend_path, per_peer, total
        self.open_by_peer: Counter[str] = Counter()
        self.refused = 0
        self._servers: list[asyncio.Server] = []
        self._sides: set[_Side] = set()
        self._warned: dict[str, float] = {}

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        backend_path: str,
        *,
        per_peer: int,
        total: int,
        reuse_port: bool = False,
    ) -> "Front":
        """Listen on every address `host` resolves to, all on one port (port 0 picks a free
        one)."""
        front = cls(backend_path, per_peer, total)
        try:
            for sock in _listening_sockets(host, port, reuse_port):
                server = await asyncio.get_running_loop().create_server(
                    front._accepted, sock=sock, backlog=1024
                )
                front._servers.append(server)
        except BaseException:
            front.close()
            raise
        return front

    @property
    def port(self) -> int:
        return self._servers[0].sockets[0].getsockname()[1]

    @property
    def connections(self) -> int:
        return len(self._sides)  # the admitted connections still open

    def _accepted(self) -> _Side:
        return _Client(self)

    def _admit(self, client: "_Client", peer: str) -> bool:
        over = (
            "per peer"
            if self.open_by_peer[peer] >= self.per_peer
            else "in all"
            if self.connections >= self.total
            else None
        )
        if over is None:
            self.open_by_peer[peer] += 1
            self._sides.add(client)
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._warned.get(peer, -WARN_EVERY) >= WARN_EVERY:
            self._warned[peer] = now
            bound = self.per_peer if over == "per peer" else self.total
            log.warning(
                "refusing connections from %s: %d open, the bound %s is %d (%d refused so far)",
                peer,
                self.open_by_peer[peer],
                over,
                bound,
                self.refused,
            )
        return False

    def _closed(self, client: "_Client", peer: str) -> None:
        self._sides.discard(client)
        self.open_by_peer[peer] -= 1
        if not self.open_by_peer[peer]:
            del self.open_by_peer[peer]

    def stop_accepting(self) -> None:
        for server in self._servers:
            server.close()

    def close(self) -> None:
        """Stop accepting and reset every relayed connection."""
        self.stop_accepting()
        for client in list(self._sides):
            if not client.transport.is_closing():
                client.transport.abort()


class _Client(_Side):
    """The public end of a relayed connection. It is admitted or reset on arrival, then joined
    to a new connection to gRPC. Bytes that arrive before the join wait here, at most HIGH_WATER
    of them: uvloop reads at once, even after `pause_reading` in `connection_made`."""

    def __init__(self, front: Front):
        super().__init__()
        self.front = front
        self.peer: str | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        peer = peer_key(transport.get_extra_info("peername")[0])
        if not self.front._admit(self, peer):
            transport.abort()  # a reset: nothing read, nothing relayed
            return
        self.peer = peer
        transport.pause_reading()  # until the connection to gRPC can take the bytes
        asyncio.get_running_loop().create_task(self._join())

    def data_received(self, data: bytes) -> None:
        if self.other is not None:
            super().data_received(data)
            return
        self.early.append(data)
        if sum(map(len, self.early)) > HIGH_WATER:
            self.transport.abort()

    async def _join(self) -> None:
        try:
            _, backend = await asyncio.get_running_loop().create_unix_connection(
                lambda: _Side(other=self), self.front.backend_path
            )
        except OSError as error:
            log.warning("front: cannot reach the gRPC server's socket: %s", error)
            self.transport.abort()
            return
        if self.transport.is_closing():  # the client left while we connected
            backend.transport.close()
            return
        self.other = backend
        for chunk in self.early:
            backend.transport.write(chunk)
        self.early = []
        self.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if self.peer is not None:
            self.front._closed(self, self.peer)


def _listening_sockets(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """One bound socket per address of `host`, all on the port that the first socket got. An
    empty host or "*" means every interface ("0.0.0.0" and "::"), as gRPC takes an empty
    host."""
    infos = socket.getaddrinfo(
        None if host in ("", "*") else host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    seen, sockets = set(), []
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(len(infos) > 1))
            if sockets[0] is not sock:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
