"""`rlhf-rewards serve --workers N`: N server processes on one port, under a supervisor.

    supervise(partial(make_scorer, args), "127.0.0.1:50051", workers=4, grace=30, token=token)

A Python process serves gRPC on one core. The supervisor (the calling process) holds the port
and spawns N workers. Each worker runs its own grpc.aio server on that port with SO_REUSEPORT
and has its own scoring processes, and the kernel spreads incoming connections over the
workers. `make_scorer` must pickle: pass a module-level function, or a partial of one. The
supervisor logs `serving ... on HOST:PORT` once every worker accepts calls, and drains them all
on SIGTERM, SIGINT or SIGHUP. It replaces a worker that dies, unless the same worker slot dies
MAX_DEATHS times within DEATH_WINDOW seconds. Workers exit when the supervisor does, even when
it is killed, because each worker watches a pipe from it.
"""

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import socket
import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait

from ferrule_grpc_auth import check_bind, split_address
from ferrule_rewards import logs
from ferrule_rewards.security import TOKEN_ENV

log = logging.getLogger(__name__)
MAX_DEATHS, DEATH_WINDOW = 3, 60.0


class WorkerFailed(Exception):
    """A worker could not start, or kept dying. `status` is the exit status to exit with."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def reserve_port(bind: str) -> socket.socket:
    """Return a socket bound to `bind` (port 0 picks a free port) that the workers can join. It
    is held open without listening. The bind itself is done without SO_REUSEPORT, so that it
    fails when anything else holds the port: a busy port is an error here, as it is for a single
    server process."""
    host, port = split_address(bind)
    sock = None
    try:
        family, kind, _, _, sockaddr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind)
        # As gRPC does, so that connections of an earlier server in TIME_WAIT do not block the
        # port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # now workers may join
    except OSError as error:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot listen on {bind}: {error.strerror or error}") from None
    return sock


def supervise(
    make_scorer,
    bind: str,
    *,
    workers: int,
    grace: float = 30.0,
    log_level="info",
    address_file: str | None = None,
    **options,
) -> None:
    """Serve with `workers` processes until SIGTERM, SIGINT or SIGHUP, then drain them all.
    `options` (token, tls, limits) go to server.start in each worker. Raises WorkerFailed when a
    worker fails before all workers serve, when one keeps dying, or when one does not stop
    cleanly."""
    if bind.startswith("unix:"):
        raise ValueError(f"--workers > 1 needs a host:port to share, not {bind}")
    tls = options.get("tls")
    client_auth = bool(tls and tls.client_ca)
    check_bind(bind, token=options.get("token"), client_auth=client_auth, token_env=TOKEN_ENV)
    held = reserve_port(bind)
    host, _ = split_address(bind)
    port = held.getsockname()[1]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # Signals wake the wait() below through this socket; the handlers themselves do nothing.
    woken, wake = socket.socketpair()
    wake.setblocking(False)
    previous_fd = signal.set_wakeup_fd(wake.fileno())
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # = server.STOP_SIGNALS
    previous = {s: signal.signal(s, lambda *_: None) for s in stop_signals}
    pool = _Pool(make_scorer, address, workers, grace, log_level, options)
    pool.address_file = address_file
    try:
        pool.run(woken)
    finally:
        unclean = pool.stop()
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for sock in (held, woken, wake):
            sock.close()
    if unclean:
        raise WorkerFailed(
            f"worker(s) {', '.join(map(str, unclean))} did not stop cleanly: the grace period "
            "ended with calls in flight (see their log lines)"
        )


class _Slot:
    """One of the N worker slots: its current process, and when earlier processes in it
    died."""

    def __init__(self, index: int):
        self.index = index
        self.process: multiprocessing.Process | None = None
        self.pipe: Connection | None = None
        self.ready = False
        self.error: tuple[str, int] | None = None  # what the worker said when it failed
        self.deaths: deque[float] = deque()


class _Pool:
    def __init__(self, make_scorer, address, workers, grace, log_level, options):
        self.worker_args = (make_scorer, address, grace, log_level, options)
        self.address, self.grace = address, grace
        self.secure = "TLS" if options.get("tls") else "plaintext"
        self.slots = [_Slot(index) for index in range(workers)]
        self.serving = False  # True once every worker accepted calls and the address was told
        self.address_file: str | None = None
        self.context = multiprocessing.get_context("spawn")  # never fork a process running gRPC

    def start(self, slot: _Slot) -> None:
        slot.pipe, child_end = self.context.Pipe()
        slot.ready, slot.error = False, None
        slot.process = self.context.Process(
            target=_worker,
            args=(slot.index, child_end, *self.worker_args),
            name=f"rlhf-rewards worker {slot.index}",
        )
        slot.process.start()
        child_end.close()

    def run(self, woken: socket.socket) -> None:
        for slot in self.slots:
            self.start(slot)
        while True:
            pipes = {slot.pipe: slot for slot in self.slots if slot.pipe is not None}
            ends = {slot.process.sentinel: slot for slot in self.slots}
            ready_ones = wait([woken, *pipes, *ends])
            # Signals first: a worker that exits now was stopped along with the supervisor.
            if woken in ready_ones:
                signum = woken.recv(1)[0]
                log.info("%s: stopping %d workers", signal.Signals(signum).name, len(ends))
                return
            for ready in ready_ones:
                if ready in ends:
                    self.replace(ends[ready])
                elif pipes[ready].pipe is ready:  # the slot was not replaced a moment ago
                    self.hear(pipes[ready])

    def hear(self, slot: _Slot) -> None:
        try:
            message = slot.pipe.recv()
        except EOFError:  # the worker has gone; its sentinel says so too
            slot.pipe.close()
            slot.pipe = None
            return
        if message[0] == "error":
            slot.error = message[1:]
            return
        slot.ready = True
        if self.serving:
            log.info("worker %d serves again (pid %d)", slot.index, slot.process.pid)
        elif all(slot.ready for slot in self.slots):
            self.serving = True
            if self.address_file:  # before the log line, as a single server does
                from ferrule_rewards.server import write_address

                write_address(self.address_file, self.address)
            pids = ", ".join(str(slot.process.pid) for slot in self.slots)
            log.info(
                "serving %s on %s (%s, %d worker processes: pids %s)",
                message[1],
                self.address,
                self.secure,
                len(self.slots),
                pids,
            )

    def replace(self, slot: _Slot) -> None:
        """A worker exited without being asked to: start another, or give up."""
        while slot.pipe is not None and slot.pipe.poll():  # what it sent before it exited
            self.hear(slot)
        slot.process.join()  # its sentinel may close a moment before it can be reaped
        code, pid = slot.process.exitcode, slot.process.pid
        why = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
        text, status = slot.error or (why, 1)
        if not self.serving:
            raise WorkerFailed(f"worker {slot.index}: {text}", status)
        now = time.monotonic()
        slot.deaths.append(now)
        while slot.deaths[0] < now - DEATH_WINDOW:
            slot.deaths.popleft()
        if len(slot.deaths) >= MAX_DEATHS:
            raise WorkerFailed(
                f"worker {slot.index} died {len(slot.deaths)} times within {DEATH_WINDOW:g}s; "
                f"the last one (pid {pid}): {text}",
                status,
            )
        log.warning("worker %d (pid %d): %s; starting another", slot.index, pid, text)
        self._restart(slot)

    def _restart(self, slot: _Slot) -> None:
        slot.process.close()
        if slot.pipe is not None:
            slot.pipe.close()
        self.start(slot)

    def stop(self) -> list[int]:
        """Send SIGTERM to every worker (each one drains), wait for them, and kill those still
        running after grace + 10 s. Returns the indices of the slots whose worker did not exit
        with status 0 (the grace period cut calls off)."""
        live = [slot for slot in self.slots if slot.process and slot.process.is_alive()]
        for slot in live:
            slot.process.terminate()
        deadline = time.monotonic() + self.grace + 10
        unclean = []
        for slot in live:
            process = slot.process
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("%s (pid %d) did not stop; killing it", process.name, process.pid)
                process.kill()
                process.join()
            if process.exitcode != 0:
                unclean.append(slot.index)
        for slot in self.slots:
            if slot.pipe is not None:
                slot.pipe.close()
        return unclean


def _worker(index, pipe, make_scorer, address, grace, log_level, options) -> None:
    """A worker process: build the scorer, serve, and tell the supervisor. Drain on SIGTERM or
    when the supervisor's end of the pipe closes."""
    # Ctrl-C and a terminal's hangup also reach the supervisor, which then stops this worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logs.configure(log_level, f"%(asctime)s %(levelname)s %(name)s[worker {index}]: %(message)s")
    from ferrule_rewards.processes import StartFailed

    try:
        cut_off = asyncio.run(_serve(make_scorer, pipe, address, grace, options))
    except StartFailed as error:  # the scorer could not be built: exit with its status
        _tell(pipe, "error", str(error), error.status)
        sys.exit(error.status)
    except (ValueError, TypeError, OSError) as error:  # bad arguments: exit 2, as cli.py does
        _tell(pipe, "error", str(error), 2)
        sys.exit(2)
    except BaseException:
        _tell(pipe, "error", traceback.format_exc().rstrip(), 1)
        sys.exit(1)
    finally:  # a multiprocessing child runs no atexit, so write the last log lines now
        logs.drain()
    sys.exit(1 if cut_off else 0)


async def _serve(make_scorer, pipe: Connection, address: str, grace: float, options) -> int:
    from ferrule_rewards.server import start, stop_requested

    server = await start(make_scorer, address, reuse_port=True, **options)
    stop = stop_requested((signal.SIGTERM,), watch=pipe.fileno())
    _tell(pipe, "ready", server.name)
    await stop.wait()
    return await server.drain(grace)


def _tell(pipe: Connection, *message) -> None:
    with contextlib.suppress(OSError):  # the supervisor is gone
        pipe.send(message)
