"""A scoring process: it builds the scorer (a reward function or a model) and scores the
requests its server hands it, one at a time, from the request's bytes to the response's.

The server (processes.py) never runs a reward function or decodes a request itself. A
function that hangs, even inside C code that holds the GIL (a regular expression that
backtracks), freezes only its own process; the server's event loop keeps answering health
checks and other calls, and its watchdog kills this process and starts another.

Talk with the server goes over a socket pair, as frames: one kind byte, a marshalled `meta`
(plain data: numbers, strings, lists, dicts; marshal runs no code) and raw bytes.

    server -> here   S  -  the pickled `make_scorer`             first: what to build
                     J  {"max_batch", "skip"}  request bytes     score this request
    here -> server   R  {"name", "hang_after", "timeout"}        built the scorer, ready
                     X  [exit status, message]                   could not build it
                     A  [n, indices without a response]          decoded; scoring starts
                     P  [[index, result], ...]                   finished results, sent ahead
                     D  {"recycle"}  response bytes              the whole response
                     E  {"recycle", "results": [[index, result], ...]}  the rest, when some
                                                                 were sent ahead or skipped
                     I  message                                  not a request we score

The pickle comes from the server that started this process, never from the network. A Mark,
shared memory, says what the process is doing: a counter bumped at every sample started, and
that sample's index (-1: the whole batch; DECODING, IDLE). The watchdog reads it even when this
process is frozen.

    python -m ferrule_rewards.child SOCKET_FD MARK_FD       # how processes.py starts one
"""

import ctypes
import marshal
import mmap
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from ferrule_rewards import tree, wire
from ferrule_rewards.functions import collect
from ferrule_rewards.records import Progress, Scores

DECODING, IDLE = -2, -3
SEND_AHEAD_EVERY = 0.05
"""Seconds between sends of finished results while a batch is scored (see _Reporter)."""
RECYCLE_GROWTH = 512 << 20
"""A process whose memory grew this much since it was ready exits after its answer and is
replaced: a large request's objects leave the heap fragmented, and only an exit returns it."""
_HEAD = struct.Struct("!cI")


def pack(kind: bytes, meta=None, body=b"") -> tuple[bytes, bytes]:
    """A frame as (head, body), so that a large body is written without being copied."""
    meta = marshal.dumps(meta)
    return _HEAD.pack(kind, len(meta)) + meta, body


def unpack(frame) -> tuple[bytes, object, memoryview]:
    view = memoryview(frame)
    kind, size = _HEAD.unpack_from(view)
    start = _HEAD.size
    return kind, marshal.loads(view[start : start + size]), view[start + size :]


class Mark:
    """[counter, index] as two int64 in memory shared by the server and one scoring process."""

    def __init__(self, fd: int):
        self.fd = fd
        self._map = mmap.mmap(fd, 16)
        self.values = memoryview(self._map).cast("q")

    @classmethod
    def create(cls) -> "Mark":
        fd = os.memfd_create("ferrule-rewards-mark")
        os.ftruncate(fd, 16)
        return cls(fd)

    def __getitem__(self, item: int) -> int:
        return self.values[item]

    def close(self) -> None:
        self.values.release()
        self._map.close()
        os.close(self.fd)


def main() -> None:
    """The process's life: build the scorer, say so, score requests until the server goes."""
    _die_with_parent()
    # Ctrl-C and a SIGTERM to the whole group (systemd stops a service so) reach the server,
    # which drains: its calls in flight still need this process. The server stops it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(socket.socket(fileno=int(sys.argv[1])).detach())
    mark = Mark(int(sys.argv[2])).values
    mark[1] = IDLE
    try:
        _, _, what = unpack(conn.recv_bytes())
        scorer = pickle.loads(what)()
    except (ValueError, TypeError, OSError) as error:  # the arguments' fault: exit status 2
        _send(conn, b"X", [2, str(error)])
        return
    except BaseException:
        _send(conn, b"X", [1, traceback.format_exc().rstrip()])
        return
    timeout = getattr(scorer, "timeout", None)
    _send(conn, b"R", {"name": scorer.name, "hang_after": scorer.hang_after, "timeout": timeout})
    threading.Thread(target=_send_ahead, name="send-ahead", daemon=True).start()
    ready_rss = _rss()
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):  # the server has gone
            return
        _, meta, body = unpack(frame)
        mark[1] = DECODING
        recycle = _score_request(conn, mark, scorer, meta, body, timeout, ready_rss)
        mark[1] = IDLE
        if recycle:
            return  # the server was told with the answer: it starts another process


def _score_request(conn, mark, scorer, meta, body, timeout, ready_rss) -> bool:
    """Score one request and answer it; True when this process should now exit."""
    try:
        samples = wire.decode(body, meta["max_batch"])
    except wire.InvalidRequest as error:
        _send(conn, b"I", str(error))
        return False
    n = len(samples)
    missing = wire.without_response(samples)
    skip = set(meta["skip"]) | set(missing)
    todo = [index for index in range(n) if index not in skip] if skip else range(n)
    _send(conn, b"A", [n, missing])
    rows = wire.rows([samples[index] for index in todo] if skip else samples, scorer.fields)
    del samples
    global _current
    reporter = _current = _Reporter(conn, mark, todo, timeout)
    try:
        scores = scorer.score(rows, reporter) if rows else Scores([])
    finally:
        with reporter.lock:
            _current = None
    recycle = _rss() > ready_rss + RECYCLE_GROWTH
    if reporter.sent or meta["skip"]:
        rest = wire.results(scores, start=reporter.sent)
        indices = list(todo)[reporter.sent :]
        results = [[index, result] for index, result in zip(indices, rest, strict=True)]
        _send(conn, b"E", {"recycle": recycle, "results": results})
        return recycle
    results = wire.results(scores)
    for index in missing:
        results.insert(index, wire.MISSING_RESPONSE)
    _send(conn, b"D", {"recycle": recycle}, wire.encode(results))
    return recycle


class _Reporter(Progress):
    """Marks each sample as it starts, and sends finished results ahead, in order (a sync
    function finishes its samples in order): every SEND_AHEAD_EVERY seconds, and from a
    thread of its own (_send_ahead) while one sample runs longer than that, so that a sample
    that hangs (and gets its process killed) loses none of the results before it. A hang that
    holds the GIL stops that thread too: then the last SEND_AHEAD_EVERY seconds of results are
    lost, and scored again by the next process unless the call's deadline has passed."""

    def __init__(self, conn, mark, todo, timeout):
        self.conn, self.mark, self.todo, self.timeout = conn, mark, todo, timeout
        self.lock = threading.Lock()
        self.pending: list = []  # outputs finished and not yet sent
        self.sent = 0  # how many of the batch's first samples were sent ahead
        self.running_since: float | None = None  # when the sample in progress started
        self.send_at = time.monotonic() + SEND_AHEAD_EVERY

    def start(self, index: int) -> None:
        self.mark[1] = self.todo[index] if index >= 0 else -1
        self.mark[0] += 1
        self.running_since = time.monotonic()

    def done(self, index: int, output: object) -> None:
        with self.lock:
            self.running_since = None
            self.pending.append(output)
            if time.monotonic() >= self.send_at:
                self.send_pending()

    def send_pending(self) -> None:
        """Send what is pending (with self.lock held)."""
        scores = Scores([0.0] * len(self.pending))
        collect(self.pending, scores, self.timeout)
        first, results = self.sent, wire.results(scores)
        _send(self.conn, b"P", [[self.todo[first + k], r] for k, r in enumerate(results)])
        self.sent += len(self.pending)
        self.pending.clear()
        self.send_at = time.monotonic() + SEND_AHEAD_EVERY


_current: _Reporter | None = None  # the batch being scored, for _send_ahead


def _send_ahead() -> None:
    """A daemon thread: while a sample runs long, send the results finished before it."""
    while True:
        time.sleep(SEND_AHEAD_EVERY / 2)
        reporter = _current
        if reporter is None:
            continue
        with reporter.lock:
            started = reporter.running_since
            if reporter.pending and started and time.monotonic() - started >= SEND_AHEAD_EVERY:
                reporter.send_pending()


def _send(conn, kind: bytes, meta=None, body=b"") -> None:
    head, body = pack(kind, meta, body)
    conn.send_bytes(head + body if body else head)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _die_with_parent() -> None:
    """SIGKILL this process when the server dies, even if it is frozen (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the server died before prctl took effect
        os._exit(1)


if __name__ == "__main__":
    tree.become_subreaper()
    try:
        main()
    finally:  # exiting by itself (recycled, or its server gone): what its function started too
        tree.kill_tree(os.getpid(), include_root=False)
