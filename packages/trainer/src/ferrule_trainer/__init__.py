"""ferrule-trainer: DeepSpeed training for the PPO family (PPO, GRPO, REINFORCE++, RLOO), SFT,
reward models and DPO, with weights exported for sync.

Other packages import the names they need to drive training from the package itself:

    from ferrule_trainer import Actor, EpochPlan, PolicyLoss, RLStep, TrainerConfig

Each name is imported on first use, so `import ferrule_trainer` stays light (no torch, no
DeepSpeed). The modules that define these names, and the RL math modules, can also be imported
directly.
"""

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

try:
    __version__ = _version("ferrule-trainer")
except PackageNotFoundError:  # imported from a source tree, e.g. benchmarks on a GPU machine
    __version__ = "0+source"

# each public name and the module that defines it
_HOMES = {
    "Actor": "actor",
    "Critic": "critic",
    "RLStep": "step",
    "Ranks": "ranks",
    "LocalRanks": "ranks",
    "PolicyGradient": "recipes",
    "RejectionSampling": "recipes",
    "IterativeDPO": "recipes",
    "Group": "groups",
    "Batch": "batch",
    "ModelConfig": "config",
    "TrainerConfig": "config",
    "CriticConfig": "config",
    "RejectionSamplingConfig": "config",
    "IterativeDPOConfig": "config",
    "EpochPlan": "settings",
    "ForwardPlan": "settings",
    "PolicyLoss": "settings",
    "ValueLoss": "settings",
    "PreferenceLoss": "settings",
    "Correction": "settings",
}
__all__ = [  # the keys of _HOMES (tests/test_public_api.py)
    "Actor",
    "Batch",
    "Correction",
    "Critic",
    "CriticConfig",
    "EpochPlan",
    "ForwardPlan",
    "Group",
    "IterativeDPO",
    "IterativeDPOConfig",
    "LocalRanks",
    "ModelConfig",
    "PolicyGradient",
    "PolicyLoss",
    "PreferenceLoss",
    "RLStep",
    "Ranks",
    "RejectionSampling",
    "RejectionSamplingConfig",
    "TrainerConfig",
    "ValueLoss",
]

if TYPE_CHECKING:
    from ferrule_trainer.actor import Actor
    from ferrule_trainer.batch import Batch
    from ferrule_trainer.config import (
        CriticConfig,
        IterativeDPOConfig,
        ModelConfig,
        RejectionSamplingConfig,
        TrainerConfig,
    )
    from ferrule_trainer.critic import Critic
    from ferrule_trainer.groups import Group
    from ferrule_trainer.ranks import LocalRanks, Ranks
    from ferrule_trainer.recipes import IterativeDPO, PolicyGradient, RejectionSampling
    from ferrule_trainer.settings import (
        Correction,
        EpochPlan,
        ForwardPlan,
        PolicyLoss,
        PreferenceLoss,
        ValueLoss,
    )
    from ferrule_trainer.step import RLStep


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ferrule_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ferrule_trainer.{home}"), name)
    globals()[name] = value  # cached: later lookups of the name skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
