"""ferrule-trainer: DeepSpeed training for the PPO family (PPO, GRPO, REINFORCE++, RLOO), SFT, reward models and DPO, with weights exported for sync."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("ferrule-trainer")
except PackageNotFoundError:  # imported from a source tree, e.g. benchmarks on a GPU machine
    __version__ = "0+source"
