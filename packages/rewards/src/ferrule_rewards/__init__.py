"""ferrule-rewards: batched reward scoring over gRPC, a standalone server that is secure by default.

Importing the package is cheap: it loads no grpc, torch or transformers. The modules:
    ferrule_rewards.client     RewardClient: score samples on one or more servers
    ferrule_rewards.server     start / serve / BackgroundServer: the gRPC server
    ferrule_rewards.functions  Python reward functions (`module:function`) as a backend
    ferrule_rewards.model      a Hugging Face reward model as a backend (the `model` extra)
    ferrule_rewards.builtin    exact_match, format_reward, math_reward
    ferrule_rewards.cli        the `rlhf-rewards` command
The wire format is proto/ferrule/rewards/v1/rewards.proto (generated code: rewards_pb2*.py).
"""

from importlib.metadata import version as _version

__version__ = _version("ferrule-rewards")
