"""ferrule-trainer: DeepSpeed training for the PPO family (PPO, GRPO, REINFORCE++, RLOO), SFT, RM and DPO, with weights exported for sync."""

from importlib.metadata import version as _version

__version__ = _version("ferrule-trainer")
