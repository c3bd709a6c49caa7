"""ferrule-weightsync: move model weights from a trainer process to inference engines.

    from ferrule_weightsync import create_sender, create_receiver

Two transports with the same verbs (`send`, `receive`, `close`): "broadcast" (NCCL on GPUs, gloo
on CPU; one sender to N receivers on any hosts) and "ipc" (CUDA IPC on a GPU, shared memory on
CPU; colocated processes). Depends on torch only. The sender's `close` ends the stream: each
receiver's `receive` then returns None. See examples/weightsync/ for a complete sender and
receiver; pass the same `secret=` to every rank to authenticate the group.

A producer that gathers or lays out the weights itself (a ZeRO-3 trainer's export) can match a
sender's buckets: `plan_buckets(specs, bucket_bytes)` is the sender's layout, and a bucket
whose tensors `lying_in_one_buffer` finds back to back in one buffer is sent without packing.
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
    """The trainer's end: `BroadcastSender` or `IpcSender` (same arguments, same `send`)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {transport!r}; choose one of {TRANSPORTS}")
    cls = BroadcastSender if transport == "broadcast" else IpcSender
    return cls(host, port, num_receivers, **options)


def create_receiver(transport: str, host: str, port: int, rank: int, num_receivers: int, **options):
    """An inference worker's end: `BroadcastReceiver` or `IpcReceiver` (same `receive`)."""
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
