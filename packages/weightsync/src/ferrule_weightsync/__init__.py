"""ferrule-weightsync: Move model weights from a trainer to inference engines: bucketed NCCL, CUDA IPC, gloo and shared-memory transports. Depends on torch only."""

from importlib.metadata import version as _version

__version__ = _version("ferrule-weightsync")
