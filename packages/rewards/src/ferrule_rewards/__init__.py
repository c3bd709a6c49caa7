"""ferrule-rewards: Batched reward scoring over gRPC: rule functions and reward models behind a standalone, secure-by-default server."""

from importlib.metadata import version as _version

__version__ = _version("ferrule-rewards")
