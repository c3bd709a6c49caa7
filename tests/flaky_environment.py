"""Environments for tests/test_agents.py: the retry task, with some episodes that go wrong."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "agents"))

from retry import RetryReversal


class SometimesBroken(RetryReversal):
    """RetryReversal, except that words starting with "a" or "b" hang in `step` and words
    starting with "c" raise there (about 1 episode in 9)."""

    def reset(self, prompt, label, metadata):
        self.first = label.strip()[-1:]  # the word's first letter, its reversal's last
        return super().reset(prompt, label, metadata)

    def step(self, model_output):
        if self.first in "ab":
            time.sleep(3600)
        if self.first == "c":
            raise RuntimeError("the environment broke")
        return super().step(model_output)
