"""The server's log, which never blocks the server, and the capped output of its scoring
processes.

    configure("info")                    # in rlhf-rewards serve, and in each of its workers
    forward(read_fd, "scoring process 1234", max_bytes=1 << 20)    # one thread per process

Each log line is queued, and a thread of its own writes it to stderr. When nobody reads the
server's stderr (a full pipe), lines are dropped and counted, and the event loop goes on
answering. Each scoring process writes its stdout and stderr (a reward function's prints) into
a pipe of its own, which `forward` reads. The first `max_bytes` of that output become log
lines; the rest is read and thrown away. So a function that floods its output neither fills a
disk nor blocks.
"""

import atexit
import logging
import logging.handlers
import os
import queue
import threading
import time

QUEUED_LINES = 10_000  # lines waiting for a slow stderr before new ones are dropped
LINE_BYTES = 8192  # a longer line is logged in pieces
log = logging.getLogger("ferrule_rewards.function")


def configure(level: str, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    """Log to stderr at `level` through a bounded queue and a writer thread. At exit, queued
    lines get DRAIN_SECONDS to be written; call `drain` where atexit does not run."""
    global _lines
    lines: queue.Queue = queue.Queue(QUEUED_LINES)
    writer = _Writer(fmt)

    class Handler(logging.handlers.QueueHandler):
        def enqueue(self, record):
            try:
                self.queue.put_nowait(record)
            except queue.Full:  # stderr is not being read: drop, never wait
                writer.dropped += 1

    handler = Handler(lines)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the writer adds the rest
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    threading.Thread(target=writer.run, args=(lines,), name="log-writer", daemon=True).start()
    _lines = lines
    atexit.register(drain)


_lines: queue.Queue | None = None
DRAIN_SECONDS = 2.0


def drain(seconds: float = DRAIN_SECONDS) -> None:
    """Wait, `seconds` at most, for the queued lines to be written."""
    deadline = time.monotonic() + seconds
    while _lines is not None and _lines.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)


class _Writer:
    """Writes each line to file descriptor 2 directly. It holds no lock that the interpreter's
    exit or logging.shutdown would wait for, so a writer stuck on a full pipe blocks only
    itself, and the process still exits."""

    def __init__(self, fmt: str):
        self.formatter = logging.Formatter(fmt)
        self.dropped = 0

    def run(self, lines: queue.Queue) -> None:
        while True:
            record = lines.get()
            try:
                text = self.formatter.format(record) + "\n"
                if self.dropped:  # report the dropped lines once stderr is read again
                    dropped, self.dropped = self.dropped, 0
                    text = f"... {dropped} log line(s) dropped: stderr was not read\n" + text
                data = text.encode(errors="replace")
                while data:
                    data = data[os.write(2, data) :]
            except OSError:  # stderr is closed: there is nowhere to report to
                pass
            finally:
                lines.task_done()


def forward(fd: int, name: str, max_bytes: int) -> threading.Thread:
    """Start a daemon thread that logs at most `max_bytes` of what the pipe `fd` carries. The
    thread reads the pipe until every writer has closed it, that is, until the process and its
    children are gone."""
    thread = threading.Thread(
        target=_forward, args=(fd, name, max_bytes), name=f"output of {name}", daemon=True
    )
    thread.start()
    return thread


def _forward(fd: int, name: str, max_bytes: int) -> None:
    left, partial = max_bytes, b""
    with open(fd, "rb", buffering=0, closefd=True) as pipe:
        while chunk := pipe.read(1 << 16):
            if left <= 0:
                continue  # past the cap: keep reading so the writer never blocks, but drop
            chunk = partial + chunk[:left]
            left -= len(chunk) - len(partial)
            *lines, partial = chunk.split(b"\n")
            if len(partial) >= LINE_BYTES or left <= 0:
                lines.append(partial)
                partial = b""
            for line in lines:
                log.info("%s: %s", name, line.decode(errors="replace"))
            if left <= 0:
                log.warning(
                    "%s: its output is past %d bytes, this server's --max-log-mb; the rest is "
                    "dropped until it is replaced",
                    name,
                    max_bytes,
                )
        if partial:
            log.info("%s: %s", name, partial.decode(errors="replace"))
