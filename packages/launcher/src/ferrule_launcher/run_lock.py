"""One run per output directory: the run holds a lock on the directory for its whole life.

    with hold(out):          # raises RunError at once if another run holds `out`
        ...                  # the run

The lock is an flock on out/.run.lock, so the kernel releases it when the holding process ends,
however it ends. After a `kill -9`, `--resume` can start at once. The file also records who
holds the lock (pid, host, start time), which the next launcher prints in its error. Two
launchers on one directory would interleave their checkpoints and metrics, so the second one is
refused before it starts anything.
"""

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ferrule_launcher.calls import RunError

LOCK_NAME = ".run.lock"


@contextlib.contextmanager
def hold(out: Path):
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunError(_held_by_another(out, path)) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _held_by_another(out: Path, path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        who = f"pid {holder['pid']} on host {holder['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        who = "a process that has not yet said who it is"
    return (
        f"[output] dir {out} is in use by another run ({who}); two runs in one directory "
        "would mix their checkpoints and metrics. Wait for it to end (or stop it), or choose "
        "another [output] dir"
    )
