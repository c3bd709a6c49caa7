"""Broadcast transport: one sender (rank 0) to N receivers over a private NCCL or gloo group.

    sender = BroadcastSender("10.0.0.1", 29600, num_receivers=2, device="cuda:0")
    sender.send(model.named_parameters())             # every rank joins a broadcast per bucket

    receiver = BroadcastReceiver("10.0.0.1", 29600, rank=1, num_receivers=2, device="cuda:0")
    update = receiver.receive()
    for name, tensor in update: ...

The group is created from a TCP store at host:port, never from the default process group, so it
works inside a DeepSpeed trainer. The group uses NCCL for CUDA devices and gloo for CPU, so the
same code runs in CI.

The sender packs bucket k+1 while bucket k is on the wire. NCCL runs on its own high-priority
stream, so packing the next bucket never delays a broadcast's launch. Each receiver posts the
next bucket before it hands bucket k to its consumer. A bucket whose tensors already lie in one
buffer, in the bucket's layout, is sent from that memory without packing. Examples are a tensor
of at least half a bucket (an embedding, say), which gets a bucket of its own, and a trainer's
export that gathers into buffers laid out by `plan_buckets` at `sender.bucket_bytes`, as
ferrule-trainer's ZeRO-3 export does.

NCCL spreads one broadcast over its own channels. gloo moves one broadcast over one TCP
connection, only as fast as one core can copy. So the gloo group opens `streams` connections,
each with its own thread, and keeps that many buckets on the wire at once (each side has one
buffer more than that). An update ends with a one-number all-reduce on the same group, which
says whether any receiver failed, so no round trip through the store is needed when all went
well.
"""

import contextlib
import time
import weakref
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from ferrule_weightsync import at_exit
from ferrule_weightsync.control import Control
from ferrule_weightsync.errors import PeerTimeoutError, WeightSyncError
from ferrule_weightsync.packing import BucketViews, TensorSpec, own_bytes, pack
from ferrule_weightsync.update import (
    END_SECONDS,
    LoadsInto,
    ReceiverState,
    Update,
    UpdateSender,
    leave,
    open_update,
)

# Measured on 2 x H200 (3 GB update, before packing by memcpy): 512 MB buckets reached 0.87-0.89
# of a raw broadcast's throughput, 256 MB buckets 0.84, and 1 GB buckets no better. Buckets
# ramping up from 16 or 64 MB were slower.
DEFAULT_BUCKET_BYTES = 512 * 2**20
# gloo, measured with 200 MB sent to 2 receivers. On 64 host cores, 4 connections and 16 MB
# buckets move an update 1.25-1.4x as fast as one raw broadcast of a flat buffer. One connection
# reaches 0.6-0.7x (the packing copy then slows the only send), and 2, 6 or 8 connections 1.1x.
# 16 and 32 cores gave 1.4-2.1x. On 2 cores, where the copies alone fill the CPU, the number of
# connections changes nothing.
GLOO_STREAMS = 4
GLOO_BUCKET_BYTES = 16 * 2**20
SPIN_SECONDS = 0.1  # a final wait polls without sleeping for this long (~40 GB at NVLink speed)


def _streams(device: torch.device, streams: int | None) -> int:
    if streams is None:
        return 1 if device.type == "cuda" else GLOO_STREAMS
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams must be a positive integer, got {streams!r}")
    if device.type == "cuda" and streams != 1:
        raise ValueError(
            f"streams={streams} is for the gloo (CPU) transport; NCCL spreads each broadcast "
            "over its own channels"
        )
    return streams


def gloo_group(store, rank: int, size: int, streams: int, timeout: float):
    """A gloo group with `streams` TCP connections: one gloo device per connection, each with
    its own I/O thread. Successive collectives take the connections in turn, and as many gloo
    threads run them side by side."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(streams)]
    options._threads = max(2, streams)
    return dist.ProcessGroupGloo(store, rank, size, options)


class _Group:
    """The private broadcast group and its reused buffers, shared by sender and receivers.

    The sender chooses `streams`; receivers learn it when they join."""

    def __init__(
        self, host, port, rank, num_receivers, device, timeout, connect_timeout, streams, secret
    ):
        self.device = torch.device(device)
        self.timeout = timeout
        self.control = Control(
            host, port, rank, num_receivers + 1, timeout, connect_timeout, secret
        )
        settings = self.control.join({"streams": streams})
        streams = settings["streams"]
        store = dist.PrefixStore("broadcast", self.control.store)
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                self.device = torch.device("cuda", torch.cuda.current_device())  # "cuda" -> :N
                options = dist.ProcessGroupNCCL.Options()
                # The sender's packing kernels (and a receiver's loads) run beside the
                # broadcasts; a high-priority stream schedules each broadcast ahead of them.
                options.is_high_priority_stream = True
                # Set later than our own deadline (see _poll): NCCL's watchdog would kill the
                # process.
                options._timeout = timedelta(seconds=2 * timeout + 60)
                self.pg = dist.ProcessGroupNCCL(store, rank, num_receivers + 1, options)
            else:
                self.pg = gloo_group(store, rank, num_receivers + 1, streams, timeout)
        except dist.DistError as err:
            raise PeerTimeoutError(
                f"rank {rank}: could not form the broadcast group at {self.control.where}: {err}"
            ) from err
        # `streams` buffers hold buckets on the wire while one more is packed by the sender (or
        # loaded by a receiver's consumer)
        self.buffers: list[torch.Tensor | None] = [None] * (streams + 1)
        self.views = BucketViews()
        self.broken = ""

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        if self.buffers[slot] is None or self.buffers[slot].numel() < nbytes:
            self.views.clear()
            self.buffers[slot] = None  # free the old one first: buckets can be large
            self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.buffers[slot][:nbytes]

    def broadcast(self, buffer: torch.Tensor) -> dist.Work:
        self.check_usable()
        return self.pg.broadcast(buffer, 0)

    def count_failures(self, failed: bool) -> int:
        """All ranks: how many receivers failed this update (each failed receiver adds a 1).
        The all-reduce is ordered after this rank's broadcasts and, on a receiver, after its
        consumer's loads."""
        self.check_usable()
        flag = torch.full((1,), int(failed), dtype=torch.int32, device=self.device)  # no copy
        self.wait(self.pg.allreduce([flag]), "the end-of-update all-reduce", final=True)
        return int(flag.item())

    def wait(self, work: dist.Work, what: str, final: bool = False) -> None:
        """Wait for `work` with a deadline, so that a dead peer cannot hang us.

        gloo: block with gloo's own timeout (gloo also raises when a peer's connection closes).
        NCCL: inside an update, only order the current stream after the broadcast, so the CPU
        does not stall between buckets. At the end (`final`), block on the CPU with a deadline,
        which bounds the whole update.
        """
        try:
            if self.device.type != "cuda":
                work.wait(timedelta(seconds=self.timeout))
            elif final:
                self._poll(work)
            else:
                work.wait()
        except TimeoutError as err:
            self.abort(f"{what} did not complete within {self.timeout:g}s")
            raise PeerTimeoutError(f"{self.control.where}: {self.broken}") from err
        except RuntimeError as err:
            self.abort(f"{what} failed: {err}")
            kind = PeerTimeoutError if "timed out" in str(err).lower() else WeightSyncError
            raise kind(f"{self.control.where}: {self.broken}") from err

    def _poll(self, work: dist.Work) -> None:
        """NCCL's own timeout would tear the whole process down, so poll with a deadline and
        abort the group ourselves. For the first SPIN_SECONDS the loop only yields the GIL
        between polls, because a sleeping poll wakes up late: on NVLink, by a measurable share
        of an update (benchmarks/RESULTS.md)."""
        started = time.monotonic()
        deadline = started + self.timeout
        while not work.is_completed():
            self.control.check_aborted()  # a sender's abort() from another thread
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError
            time.sleep(0 if now - started < SPIN_SECONDS else 0.001)
        work.wait()

    def check_usable(self) -> None:
        if self.broken:
            raise WeightSyncError(
                f"{self.control.where} is unusable after an earlier failure ({self.broken}); "
                "create a new sender and receivers"
            )

    def abort(self, reason: str) -> None:
        self.broken = reason
        with contextlib.suppress(RuntimeError):  # aborting a group that already failed
            if self.pg is not None:  # None: closed
                self.pg.abort()

    def close(self) -> None:
        if self.pg is None:  # closed already
            return
        self.buffers = [None] * len(self.buffers)
        self.views.clear()
        if not self.broken:
            self.pg.shutdown()
        # Destroy the group now, while the interpreter is whole. A gloo group left for the
        # interpreter's teardown can abort the process as its worker threads are destroyed
        # (SIGABRT, "terminate called without an active exception": once in CI, 2026-12-01,
        # after a sender closed at exit; the failure pytorch/pytorch#179291 describes).
        self.pg = None
        self.control.close()


class BroadcastSender:
    """Rank 0 of the group: sends named tensors to every receiver, one bucket per broadcast.

    `timeout` bounds every step of an update (a dead or stuck peer raises `PeerTimeoutError`);
    `connect_timeout` bounds the wait for all receivers to join, which may include an inference
    engine's start-up. `checksums=True` verifies every bucket on every receiver. `bucket_bytes`
    defaults to 512 MB on CUDA and 16 MB on CPU. `streams` (CPU only, default 4) is the number
    of TCP connections the gloo group uses, and so of buckets in flight; receivers learn it when
    they join. `secret` (16+ bytes, the same on every rank): receivers must prove they know it
    to join, and every control message is signed with a session key made from it (see
    messages.py).
    """

    def __init__(
        self,
        host: str,
        port: int,
        num_receivers: int,
        device: str | torch.device = "cpu",
        bucket_bytes: int | None = None,
        checksums: bool = False,
        timeout: float = 120.0,
        connect_timeout: float = 900.0,
        streams: int | None = None,
        secret: str | bytes | None = None,
    ):
        device = torch.device(device)
        streams = _streams(device, streams)  # checked before connecting: a bad value starts nothing
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES if device.type == "cuda" else GLOO_BUCKET_BYTES
        self._group = _Group(
            host, port, 0, num_receivers, device, timeout, connect_timeout, streams, secret
        )
        self._updates = UpdateSender(self._group.control, bucket_bytes, checksums)
        # A sender that is never closed closes when it is collected, at interpreter exit or on
        # SIGTERM (at_exit.py).
        self._closer = at_exit.close_at_exit(self, _close_sender, self._updates, self._group)

    @property
    def version(self) -> int:
        """The version of the last completed update (0 before the first)."""
        return self._updates.version

    @property
    def bucket_bytes(self) -> int:
        """The bucket size this sender lays updates out with (`plan_buckets`)."""
        return self._updates.bucket_bytes

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        specs: list[TensorSpec] | None = None,
        in_place: bool = False,
    ) -> int:
        """Send one update and return its version (default: the previous one + 1).

        `named_tensors` may be a lazy stream (e.g. ZeRO-3 parameters gathered bucket by bucket).
        In that case pass `specs` in the same order, so that receivers can check the update
        before it starts. Returns when every receiver has consumed the update. Raises
        `WeightSyncError` naming the receiver that failed, or `MismatchError` when a receiver
        refused the update before any data moved. `in_place` is accepted to match
        `IpcSender.send`; a broadcast moves the bytes either way.
        """
        self._group.control.check_open()
        self._group.check_usable()
        return self._updates.send(named_tensors, self._send_buckets, version, specs)

    def _send_buckets(self, seq, stream) -> bool:
        slots = len(self._group.buffers)
        # (work, the bytes it sends). Holding the bytes keeps a tensor whose bucket is sent from
        # its own memory alive until the broadcast is done, even if a lazy stream drops it.
        in_flight: list[tuple[dist.Work, torch.Tensor] | None] = [None] * slots
        for bucket, tensors in stream:
            slot = bucket.index % slots
            if in_flight[slot] is not None:  # the buffer still holds an earlier bucket
                work, _ = in_flight[slot]
                self._group.wait(work, f"broadcast of bucket {bucket.index - slots}")
            payload = own_bytes(tensors, bucket, self._group.device)
            if payload is None:
                payload = self._group.buffer(slot, bucket.nbytes)
                pack(self._group.views(payload, bucket), tensors)
            self._updates.packed(seq, bucket, payload)
            in_flight[slot] = (self._group.broadcast(payload), payload)
        for index, sent in enumerate(in_flight):
            if sent is not None:  # NCCL: orders the stream only; the all-reduce below waits
                self._group.wait(sent[0], f"broadcast of the last buckets (slot {index})")
        return self._group.count_failures(False) > 0

    def abort(self, reason: str) -> None:
        """End a `send` that is blocked in another thread, for example because a receiver died.
        The `send` raises `WeightSyncError` with `reason`: at once if it waits for the
        receivers' reports, and within one poll if it is in an NCCL transfer (the group is
        aborted). A gloo transfer ends when the dead receiver's connection closes. The sender is
        unusable afterwards: close it and open a new group."""
        self._group.control.abort(reason)
        self._group.abort(f"aborted: {reason}")

    def close(self, timeout: float = END_SECONDS) -> None:
        """End the stream, so that each receiver's `receive` returns None. Waits up to `timeout`
        seconds for the receivers to read the end (0: no wait), then leaves the group. A
        receiver that calls `receive` after the group is gone gets `WeightSyncError`. A sender
        that is never closed does this when it is collected, at interpreter exit or on SIGTERM
        (see at_exit.py)."""
        at_exit.close_now(self._closer, timeout=timeout, exiting=False)


def _close_sender(
    updates: UpdateSender, group: _Group, timeout: float = END_SECONDS, exiting: bool = True
) -> None:
    """Close a sender. With `exiting` (at exit or on SIGTERM), a sender interrupted inside
    `send` leaves the group as it is, because a transfer may be in flight; its receivers see
    the sender go away."""
    if exiting and updates.sending:
        return
    if not group.broken:
        updates.end(min(group.timeout, timeout))
    group.close()


class BroadcastReceiver(LoadsInto):
    """Rank 1..N of the group: receives every update the sender broadcasts."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        num_receivers: int,
        device: str | torch.device = "cpu",
        timeout: float = 120.0,
        connect_timeout: float = 900.0,
        secret: str | bytes | None = None,
    ):
        if not 1 <= rank <= num_receivers:
            raise ValueError(f"receiver rank must be in [1, {num_receivers}], got {rank}")
        self._group = _Group(
            host, port, rank, num_receivers, device, timeout, connect_timeout, None, secret
        )
        self._state = ReceiverState()
        # On close or process exit, tell a sender that closes later not to wait for this rank.
        self._leave = weakref.finalize(self, leave, self._group.control, self._state)

    def receive(
        self,
        expected: Mapping | None = None,
        cast: bool | torch.dtype = False,
        timeout: float | None = None,
        partial: bool = False,
    ) -> Update | None:
        """Wait for the next update, up to `timeout` seconds (None: as long as the sender lives).
        Returns None once the sender has closed and the stream has ended; every later call also
        returns None. So a receiver's loop is `while (update := receiver.receive()) is not None:`.

        With `expected` (a state dict or name -> TensorSpec), the receiver refuses an update
        before any data moves if the update holds a tensor that `expected` lacks, or one whose
        shape or dtype differs, or (unless `partial`) if it lacks any expected name. `cast=True`
        converts to the expected dtypes instead of refusing a dtype difference;
        `cast=torch.bfloat16` converts every floating-point tensor.
        """
        if self._state.ended:
            return None
        self._group.check_usable()
        control = self._group.control
        return open_update(
            control, self._state, self._receive_buckets, expected, cast, timeout, self._finish,
            partial,
        )  # fmt: skip

    def _finish(self, seq: int, error: str) -> None:
        if error:  # the sender reads why once the all-reduce says that someone failed
            self._group.control.report(seq, "done", error)
        if not self._group.broken:  # else the sender is gone, or will time out on us
            self._group.count_failures(bool(error))

    def _receive_buckets(self, seq, layout, manifest):
        buckets = layout.buckets
        slots = len(self._group.buffers)
        posted = {}

        def post(index: int) -> None:
            buffer = self._group.buffer(index % slots, buckets[index].nbytes)
            posted[index] = (buffer, self._group.broadcast(buffer))

        for index in range(min(slots - 1, len(buckets))):
            post(index)
        for bucket in buckets:
            buffer, work = posted.pop(bucket.index)
            # NCCL: orders our stream after the broadcast, without a CPU wait; the end-of-update
            # all-reduce (_finish) is the wait with a deadline.
            self._group.wait(work, f"broadcast of bucket {bucket.index}")
            ahead = bucket.index + slots - 1
            if ahead < len(buckets):  # its slot held the previous bucket, already consumed
                post(ahead)
            yield bucket, buffer

    def close(self) -> None:
        self._leave()
        self._group.close()
