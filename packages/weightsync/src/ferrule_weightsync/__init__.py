"""ferrule-weightsync: move model weights from a trainer process to inference engines.

    from ferrule_weightsync import create_sender, create_receiver

There are two transports, and both have the same methods (`send`, `receive`, `close`):
"broadcast" uses NCCL on GPUs and gloo on CPU, and sends from one sender to N receivers on any
hosts; "ipc" uses CUDA IPC on a GPU and shared memory on CPU, for colocated processes. The
package depends on torch only. The sender's `close` ends the stream, after which each
receiver's `receive` returns None. See examples/weightsync/ for a complete sender and receiver.
To authenticate the group, pass the same `secret=` to every rank.

A producer that gathers or lays out the weights itself (such as a ZeRO-3 trainer's export) can
match the sender's buckets. `plan_buckets(specs, bucket_bytes)` returns the layout the sender
uses. When `lying_in_one_buffer` finds a bucket's tensors back to back in one buffer, the
sender sends that buffer as it is, without packing.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from ferrule_weightsync.broadcast import BroadcastReceiver, BroadcastSender
from ferrule_weightsync.errors import (
    ForgedMessageError,
    MalformedMessageError,
    MismatchError,
    PeerTimeoutError,
    WeightSyncError,
)
from ferrule_weightsync.ipc import IpcReceiver, IpcSender
from ferrule_weightsync.packing import (
    Bucket,
    TensorSpec,
    digest,
    lying_in_one_buffer,
    plan_buckets,
)
from ferrule_weightsync.update import Update

try:
    __version__ = _version("ferrule-weightsync")
except PackageNotFoundError:  # copied into another project's tree, or run from a source checkout
    __version__ = "0+source"
TRANSPORTS = ("broadcast", "ipc")


def create_sender(transport: str, host: str, port: int, num_receivers: int, **options):
    """Create the trainer's end of the group: a `BroadcastSender` or an `IpcSender`. Both take
    the same required arguments and have the same `send`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {TRANSPORTS}")
    cls = BroadcastSender if transport == "broadcast" else IpcSender
    return cls(host, port, num_receivers, **options)


def create_receiver(transport: str, host: str, port: int, rank: int, num_receivers: int, **options):
    """Create an inference worker's end of the group: a `BroadcastReceiver` or an
    `IpcReceiver`. Both have the same `receive`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {TRANSPORTS}")
    cls = BroadcastReceiver if transport == "broadcast" else IpcReceiver
    return cls(host, port, rank, num_receivers, **options)


__all__ = [
    "TRANSPORTS",
    "BroadcastReceiver",
    "BroadcastSender",
    "Bucket",
    "ForgedMessageError",
    "IpcReceiver",
    "IpcSender",
    "MalformedMessageError",
    "MismatchError",
    "PeerTimeoutError",
    "TensorSpec",
    "Update",
    "WeightSyncError",
    "create_receiver",
    "create_sender",
    "digest",
    "lying_in_one_buffer",
    "plan_buckets",
]
