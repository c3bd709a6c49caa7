"""examples/rl_in_one_file.py, the first file a newcomer reads, runs and learns: over 20 GRPO
steps the reward of its last five steps beats that of its first five."""

import re
import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "rl_in_one_file.py"


def test_the_one_file_loop_runs_and_its_reward_rises(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "20"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    rewards = [float(re.search(r"reward (\S+)", line).group(1)) for line in lines]
    assert len(rewards) == 20, lines
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.03, rewards
