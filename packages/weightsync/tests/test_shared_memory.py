"""The CPU IPC transport's shared-memory segments: a sender killed outright leaves its segment
behind (nothing runs in a SIGKILLed process group, Python's resource tracker included), and the
next sender to start removes it, but never the segment of a sender that is still alive."""

import os
import signal
import subprocess
import sys

import torch

from ferrule_weightsync import ipc

HOLDER = """
import time, torch
from ferrule_weightsync.ipc import _SharedBuffer
buffer = _SharedBuffer(1 << 16, torch.device("cpu"))
print(buffer.shm.name, flush=True)
time.sleep(300)
"""


def _holder():
    """A process holding one segment, in a process group of its own; (process, segment)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    name = process.stdout.readline().strip()
    assert name.startswith("ferrule-ws-"), name
    return process, ipc.SEGMENTS / name


def test_a_killed_senders_segment_is_removed_by_the_next_one_and_a_living_senders_kept():
    dead, dead_segment = _holder()
    alive, alive_segment = _holder()
    try:
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait(30)
        assert dead_segment.exists()  # the leak: its creator could not remove it
        ours = ipc._SharedBuffer(4096, torch.device("cpu"))
        try:
            assert not dead_segment.exists()
            assert alive_segment.exists()
            assert (ipc.SEGMENTS / ours.shm.name).exists()
            with ipc._segments_locked():  # a second sweep spares the living, ours included
                removed = ipc.remove_orphaned_segments()
            assert alive_segment.name not in removed and ours.shm.name not in removed
            assert alive_segment.exists() and (ipc.SEGMENTS / ours.shm.name).exists()
        finally:
            ours.close()
        assert not (ipc.SEGMENTS / ours.shm.name).exists()
    finally:
        os.killpg(alive.pid, signal.SIGKILL)
        alive.wait(30)
        dead_segment.unlink(missing_ok=True)
        alive_segment.unlink(missing_ok=True)
