"""examples/rl_in_one_file.py, the first file a newcomer reads, runs as written and learns:
over 20 GRPO steps the reward of its last five steps beats that of its first five."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "rl_in_one_file.py"


@pytest.mark.e2e  # 16 s: a process of its own, 20 RL steps
def test_the_one_file_loop_runs_and_its_reward_rises():
    # a process of its own, as a user runs it: the script starts its own torch.distributed
    # group and DeepSpeed engines, which must not meet the groups of tests run before it
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "20"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    rewards = [float(re.search(r"reward (\S+)", line).group(1)) for line in lines]
    assert len(rewards) == 20, result.stdout
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.03, rewards
