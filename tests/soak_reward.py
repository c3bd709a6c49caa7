"""The soak test's reward function: the tiny example's reward, and a line per scored sample
("<server pid> <sample_id>"; the function runs in a child of the server) appended to $FERRULE_SOAK_LOG, so that the test can tell which
samples were scored, how often and by which server process."""

import os

from ferrule_rewards.builtin import char_match


def logged_char_match(response: str, label: str, metadata: dict) -> float:
    with open(os.environ["FERRULE_SOAK_LOG"], "a") as log:  # one short append: atomic
        log.write(f"{os.getppid()} {metadata['sample_id']}\n")
    return char_match(response, label)
