"""Kill a scoring process together with everything it started. Whatever a reward function
forks or spawns (`os.fork`, `Popen(start_new_session=True)`, a daemon's double fork) dies with
the scoring process.

    become_subreaper()            # first thing in the scoring process's reaper (child.py)
    kill_tree(pid)                # in the server: the process and all its descendants
    kill_tree(os.getpid(), include_root=False)   # a process's descendants, before it exits

A scoring process is a child subreaper (PR_SET_CHILD_SUBREAPER). When a process in its subtree
is orphaned, the kernel re-parents it to the scoring process instead of init. So every process
that the scoring process started stays among its descendants in /proc, whatever it does:
setsid leaves a process group and a session, but never the tree. Killing a process group or a
session alone would miss `setsid`. A cgroup would need privileges or systemd's delegation,
which a `pip install`ed server cannot count on. `kill_tree` stops each member with SIGSTOP and
lists the tree again until no new member appears (a stopped process cannot fork), then sends
SIGKILL to them all. This cannot cover a server that is itself killed with SIGKILL. Its scoring
processes die with it (through PR_SET_PDEATHSIG), but their children are orphaned to init. Run
the server under systemd or in a container to cover that case.
"""

import contextlib
import ctypes
import os
import signal
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process adopt the orphans of its subtree (Linux 3.4+; a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(pid: int) -> list[int]:
    """The pids of all processes below `pid`, read from /proc/PID/task/*/children. Only the
    processes alive at the time of reading are found."""
    found, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found


def _children(pid: int) -> list[int]:
    """The children of each thread of `pid`, or [] once `pid` has exited. A process can exit
    between being listed and being read. /proc then answers ENOENT, or ESRCH while the process
    is a zombie. Any other error (EMFILE) is raised, because a kill must not miss a process
    silently."""
    gone = (FileNotFoundError, ProcessLookupError)
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except gone:
        return []
    children = []
    for thread in threads:
        with contextlib.suppress(gone):
            children += map(int, Path(f"/proc/{pid}/task/{thread}/children").read_text().split())
    return children


def kill_tree(pid: int, *, include_root: bool = True) -> int:
    """Send SIGKILL to every process below `pid`, and to `pid` itself when `include_root`.
    Returns how many processes were signalled."""
    stopped: set[int] = set()
    while True:
        members = descendants(pid) + ([pid] if include_root else [])
        new = [member for member in members if member not in stopped]
        if not new:
            break
        for member in new:
            _signal(member, signal.SIGSTOP)
            stopped.add(member)
    for member in stopped:
        _signal(member, signal.SIGKILL)
    return len(stopped)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)
