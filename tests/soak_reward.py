"""The soak test's reward function: the tiny example's reward, and a line per scored sample
("<server pid> <sample_id>") appended to $FERRULE_SOAK_LOG, so that the test can tell which
samples were scored, how often and by which server. The function runs in a scoring process
whose parent is its reaper (ferrule_rewards' child.py), a child of the server: the server is
the grandparent (the parent's pid was logged before, so a sample the killed server had in hand
showed its reaper's pid, not the server's, and the soak failed on that seed).

The server's pid is read once, when the scoring process imports this module, while its server
is alive. Read at each call, a sample scored in the moment after the server was killed (its
reaper not yet dead of the parent-death signal, already handed to a new parent) logged that new
parent's parent, and the soak failed on seed 1796036391."""

import os
from pathlib import Path

from ferrule_rewards.builtin import char_match


def server_pid() -> int:
    """The reaper's parent: field 4 of /proc/<reaper>/stat (after the parenthesised name)."""
    reaper = Path(f"/proc/{os.getppid()}/stat").read_text()
    return int(reaper.rsplit(")", 1)[1].split()[1])


SERVER = server_pid()


def logged_char_match(response: str, label: str, metadata: dict) -> float:
    with open(os.environ["FERRULE_SOAK_LOG"], "a") as log:  # one short append: atomic
        log.write(f"{SERVER} {metadata['sample_id']}\n")
    return char_match(response, label)
