"""A scoring process. It builds the scorer (a reward function or a model) and scores the
requests that its server hands it, one at a time, from the request's bytes to the response's.

The server (processes.py) never runs a reward function or decodes a request itself. A
function that hangs, even inside C code that holds the GIL (a regular expression that
backtracks), freezes only its own process. The server's event loop keeps answering health
checks and other calls, and the server's watchdog kills this process and starts another.

This process talks with the server over a socket pair, in frames. A frame is one kind byte, a
marshalled `meta` (plain data: numbers, strings, lists, dicts; marshal runs no code) and raw
bytes.

    server -> here   S  -  the pickled `make_scorer`             first: what to build
                     J  {"max_batch", "skip", "max_bytes",       score this request, but not
                         "max_sub_scores", "used"}  request bytes   the samples in skip
    here -> server   R  {"name", "hang_after", "timeout"}        built the scorer, ready
                     X  [exit status, message]                   could not build it
                     A  [n, indices without a response]          decoded; scoring starts
                     D  {"recycle"}  response bytes              the whole response
                     E  {"recycle"}                              done: the results are in the
                                                                 journal (some were skipped)
                     I  message                                  not a request we score

The pickle comes from the server that started this process, never from the network. A Mark,
in shared memory, says what the process is doing. It holds a counter, bumped each time a sample
starts, and the index of that sample (-1 for the whole batch, or DECODING or IDLE). The
watchdog reads the Mark even when this process is frozen. The same memory holds the journal
(journal.py). Each result is written there as its sample finishes, and the server reads the
journal when this process dies or is killed mid-batch.

    python -P -m ferrule_rewards.child SOCKET_FD MARK_FD    # how processes.py starts one

The process forks first. The parent runs no reward function: it is a child subreaper that
reaps the orphans of the scoring child's subtree. Once the scoring child has gone, the parent
kills what is left of the tree and exits the same way the child did (see _reap_orphans).
"""

import contextlib
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
import traceback
from multiprocessing.connection import Connection

from ferrule_rewards import tree, wire
from ferrule_rewards.functions import collect, reward_of
from ferrule_rewards.journal import Journal
from ferrule_rewards.records import Progress, Scores

DECODING, IDLE = -2, -3
RECYCLE_GROWTH = 512 << 20
"""Bytes of memory growth since the scoring process was ready. A process that has grown this
much exits after its answer, and the server replaces it. The objects of a large request leave
the heap fragmented, and only an exit gives that memory back to the system."""
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
        os.ftruncate(fd, 24)  # with the journal's end offset (journal.py); 0 means empty
        return cls(fd)

    def __getitem__(self, item: int) -> int:
        return self.values[item]

    def close(self) -> None:
        self.values.release()
        self._map.close()
        os.close(self.fd)


def main() -> None:
    """Build the scorer, tell the server, then score requests until the server goes away."""
    # Ctrl-C and a SIGTERM to the whole group (this is how systemd stops a service) also reach
    # the server, which drains. Its calls in flight still need this process, so this process
    # ignores those signals, and the server stops it.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
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
    journal = Journal(int(sys.argv[2]))
    ready_rss = _rss()
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):  # the server has gone
            return
        _, meta, body = unpack(frame)
        mark[1] = DECODING
        recycle = _score_request(conn, mark, journal, scorer, meta, body, timeout, ready_rss)
        mark[1] = IDLE
        if recycle:
            return  # the answer told the server, which starts another process


def _score_request(conn, mark, journal, scorer, meta, body, timeout, ready_rss) -> bool:
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
    journal.reset()
    _send(conn, b"A", [n, missing])
    rows = wire.rows([samples[index] for index in todo] if skip else samples, scorer.fields)
    del samples
    budget = wire.Budget(meta["max_bytes"], meta["max_sub_scores"], n - len(meta["skip"]))
    budget.used = meta["used"]
    reporter = _Reporter(mark, journal, todo, timeout, budget)
    scores = scorer.score(rows, reporter) if rows else Scores([])
    chunks = reporter.chunks
    if len(chunks) < len(todo):  # a per-batch or async function returns all results at once
        chunks = [budget.fit(result) for result in wire.results(scores)]
        if meta["skip"]:
            for index, data in zip(todo, chunks, strict=True):
                journal.append(index, data)
    recycle = _rss() > ready_rss + RECYCLE_GROWTH
    if meta["skip"]:  # the server holds some results, so it reads these from the journal
        _send(conn, b"E", {"recycle": recycle})
        return recycle
    for index in missing:
        chunks.insert(index, wire.MISSING_CHUNK)
    chunks = wire.within(chunks, meta["max_bytes"])
    _send(conn, b"D", {"recycle": recycle}, b"".join(chunks))
    return recycle


class _Reporter(Progress):
    """Marks each sample as it starts, and writes each result to the journal as the sample
    finishes, before the next one starts. After a crash or a kill, the server finds every
    finished sample in the journal and scores none of them again."""

    takes_outputs = True

    def __init__(self, mark, journal, todo, timeout, budget: wire.Budget):
        self.mark, self.journal, self.todo = mark, journal, todo
        self.timeout, self.budget = timeout, budget
        self.chunks: list[bytes] = []

    def start(self, index: int) -> None:
        self.mark[1] = self.todo[index] if index >= 0 else -1
        self.mark[0] += 1

    def done(self, index: int, output: object) -> None:
        data = None
        if type(output) is float and output - output == 0.0:  # finite: most outputs
            data = wire.float_chunk(output)
            self.budget.left -= 1
            self.budget.used += len(data)
        elif type(output) is dict and len(output) > self.budget.max_sub_scores + 1:
            # Refused before checking each value: checking a million values takes longer than
            # a timeout.
            data = self.budget.fit(self.budget.too_many(len(output) - 1))
        elif type(output) is dict:  # with sub-scores, the next most common output
            try:
                reward, subs = reward_of(output)
            except Exception:
                pass  # collect below says what is wrong
            else:
                data = self.budget.fit(
                    {"reward": reward, "sub_scores": subs} if subs else {"reward": reward}
                )
        if data is None:
            scores = Scores([0.0])
            collect([output], scores, self.timeout)
            data = self.budget.fit(wire.results(scores)[0])
        self.journal.append(self.todo[index], data)
        self.chunks.append(data)


def _send(conn, kind: bytes, meta=None, body=b"") -> None:
    head, body = pack(kind, meta, body)
    conn.send_bytes(head + body if body else head)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent (the server, or `parent`) dies, even if it is
    frozen (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1 or (parent and os.getppid() != parent):  # it died before prctl
        os._exit(1)


def _reap_orphans() -> None:
    """Fork. The child returns and scores. This process, a child subreaper that runs no reward
    function, adopts the orphans of the child's subtree and reaps them. The scorer cannot reap
    them itself: it could reap a child that its function still waits for. Once the scorer has
    exited, this process kills what is left of the tree and ends the way the scorer did, so the
    server sees the scorer's status. The pid that the server holds for the scoring process is
    this process's pid, so a kill reaches both."""
    tree.become_subreaper()
    _die_with_parent()
    reaper = os.getpid()
    scorer = os.fork()
    if scorer == 0:
        _die_with_parent(reaper)
        return
    for fd in (int(sys.argv[1]), int(sys.argv[2])):  # so the server sees EOF when the scorer exits
        os.close(fd)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    while True:
        pid, status = os.wait()
        if pid == scorer:
            break
    # The scorer exited by itself (recycled, its server gone, or dead): kill what its
    # function started too.
    tree.kill_tree(reaper, include_root=False)
    with contextlib.suppress(ChildProcessError):
        while True:
            os.wait()
    if os.WIFSIGNALED(status):
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's handler cannot be set
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(reaper, os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    _reap_orphans()
    main()
