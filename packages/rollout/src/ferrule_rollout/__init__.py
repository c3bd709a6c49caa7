"""ferrule-rollout: A vLLM rollout engine and gRPC server with in-place weight updates and policy versions."""

from importlib.metadata import version as _version

__version__ = _version("ferrule-rollout")
