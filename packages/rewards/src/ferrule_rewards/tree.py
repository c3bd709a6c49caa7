"""A scoring process and everything it started, killed together: what a reward function forks
or spawns (`os.fork`, `Popen(start_new_session=True)`, a daemon's double fork) dies with it.

    become_subreaper()            # in the scoring process's reaper (child.py), first thing
    kill_tree(pid)                # the server: the process and all its descendants
    kill_tree(os.getpid(), include_root=False)   # the process, before it exits by itself

A scoring process is a child subreaper (PR_SET_CHILD_SUBREAPER): an orphan of its subtree is
re-parented to it instead of init, so every process it started stays among its descendants in
/proc whatever they do (setsid leaves a process group and a session, never the tree). A process
group or session alone would miss `setsid`; a cgroup would need privileges or systemd's
delegation, which a `pip install`ed server cannot count on. `kill_tree` stops each member with
SIGSTOP and looks again until no new one appears (a stopped process cannot fork), then SIGKILLs
them all. What this cannot reach: a server killed with SIGKILL itself (its scoring processes
die with it, through PR_SET_PDEATHSIG, and their children are orphaned to init): run the server
under systemd or in a container to cover that.
"""

import contextlib
import ctypes
import os
import signal
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Adopt the orphans of this process's subtree (Linux 3.4+; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc/PID/task/*/children (those alive as it is read)."""
    found, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found


def _children(pid: int) -> list[int]:
    """The children of each of `pid`'s threads; none once it has exited. A process can exit
    between being listed and being read: /proc then answers ENOENT or, while it is a zombie,
    ESRCH. Any other error (EMFILE) is raised: a kill must not miss a process silently."""
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
    """SIGKILL `pid` (unless not `include_root`) and every process below it; how many."""
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
