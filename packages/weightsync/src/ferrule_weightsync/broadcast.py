"""Broadcast transport: one sender (rank 0) to N receivers over a private NCCL or gloo group.

    sender = BroadcastSender("10.0.0.1", 29600, num_receivers=2, device="cuda:0")
    sender.send(model.named_parameters())             # every rank joins a broadcast per bucket

    receiver = BroadcastReceiver("10.0.0.1", 29600, rank=1, num_receivers=2, device="cuda:0")
    update = receiver.receive()
    for name, tensor in update: ...

The group is created from a TCP store at host:port, never from the default process group, so it
lives happily inside a DeepSpeed trainer. NCCL for CUDA devices, gloo for CPU: the same code runs
in CI. The sender packs bucket k+1 while bucket k is on the wire (NCCL runs on its own
high-priority stream, so the next bucket's packing never delays its launch), and each receiver
posts the next bucket before handing bucket k to its consumer. A bucket whose tensors already
lie in one buffer in the bucket's layout goes from that memory, unpacked: a tensor of at least
half a bucket (an embedding, say), which gets a bucket of its own, or a trainer's export that
gathers into buffers laid out by `plan_buckets` at `sender.bucket_bytes` (ferrule-trainer's
ZeRO-3 export does).
NCCL spreads one broadcast over its own channels; gloo moves one broadcast over one TCP
connection, at what one core can copy, so the gloo group opens `streams` connections, each with
its own thread, and keeps that many buckets on the wire at once (one buffer more than that on
each side). An update ends with a one-number all-reduce on the same group, which says whether
any receiver failed: no round trip through the store when all went well.
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

# Measured on 2 x H200 (3 GB update, before packing by memcpy): 512 MB buckets 0.87-0.89 of a raw
# broadcast, 256 MB 0.84, 1 GB no better; buckets ramping up from 16 or 64 MB were slower.
DEFAULT_BUCKET_BYTES = 512 * 2**20
# gloo, measured with 200 MB to 2 receivers: on 64 host cores 4 connections and 16 MB buckets
# move an update 1.25-1.4x as fast as one raw broadcast of a flat buffer, one connection 0.6-0.7x
# (the packing copy then slows the only send), 2, 6 or 8 connections 1.1x; 16 and 32 cores gave
# 1.4-2.1x. On 2 cores, where the copies alone fill the CPU, the connections change nothing.
GLOO_STREAMS = 4
GLOO_BUCKET_BYTES = 16 * 2**20
SPIN_SECONDS = 0.1  # a final wait polls without sleeping this long (~40 GB at NVLink speed)


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
    """A gloo group with `streams` TCP connections: one device each, each with its own I/O
    thread. Collectives take the connections in turn, and as many gloo threads run them side by
    side."""
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
                # Our buckets' packing kernels (and a receiver's loads) run beside the
                # broadcasts; a high-priority stream schedules each broadcast ahead of them.
                options.is_high_priority_stream = True
                # Later than our own deadline (see _poll): NCCL's watchdog would kill the process.
                options._timeout = timedelta(seconds=2 * timeout + 60)
                self.pg = dist.ProcessGroupNCCL(store, rank, num_receivers + 1, options)
            else:
                self.pg = gloo_group(store, rank, num_receivers + 1, streams, timeout)
        except dist.DistError as err:
            raise PeerTimeoutError(
                f"rank {rank}: could not form the broadcast group at {self.control.where}: {err}"
            ) from err
        # `streams` buckets on the wire while the sender packs (or a receiver's consumer loads)
        # one more
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
        """All ranks: how many receivers failed this update (each says so with a 1). Ordered
        after this rank's broadcasts and, on a receiver, after its consumer's loads."""
        self.check_usable()
        flag = torch.full((1,), int(failed), dtype=torch.int32, device=self.device)  # no copy
        self.wait(self.pg.allreduce([flag]), "the end-of-update all-reduce", final=True)
        return int(flag.item())

    def wait(self, work: dist.Work, what: str, final: bool = False) -> None:
        """Wait for `work`, with a deadline: a dead peer must not hang us.

        gloo: block with gloo's own timeout (it also raises when a peer's connection closes).
        NCCL: inside an update, only order the current stream after the broadcast (no CPU
        stall between buckets); at the end (`final`), block on the CPU with a deadline, which
        bounds the whole update.
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
        """NCCL: its own timeout would tear the whole process down, so poll with a deadline
        and abort the group ourselves. The first SPIN_SECONDS only yield the GIL between polls:
        a sleeping poll wakes up late (by a measurable share of an update on NVLink;
        benchmarks/RESULTS.md)."""
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
            self.pg.abort()

    def close(self) -> None:
        self.buffers = [None] * len(self.buffers)
        self.views.clear()
        if not self.broken:
            self.pg.shutdown()
        self.control.close()


class BroadcastSender:
    """Rank 0 of the group: sends named tensors to every receiver, one bucket per broadcast.

    `timeout` bounds every step of an update (a dead or stuck peer raises `PeerTimeoutError`);
    `connect_timeout` bounds the wait for all receivers to join, which may include an inference
    engine's start-up. `checksums=True` verifies every bucket on every receiver. `bucket_bytes`
    defaults to 512 MB on CUDA and 16 MB on CPU; `streams` (CPU only, default 4) is how many
    TCP connections, and buckets in flight, the gloo group uses. Receivers learn it on joining.
    `secret` (16+ bytes, the same on every rank): receivers must prove they know it to join,
    and every control message is signed with it (see messages.py).
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
        streams = _streams(device, streams)  # before connecting: a bad value starts nothing
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES if device.type == "cuda" else GLOO_BUCKET_BYTES
        self._group = _Group(
            host, port, 0, num_receivers, device, timeout, connect_timeout, streams, secret
        )
        self._updates = UpdateSender(self._group.control, bucket_bytes, checksums)
        # never closed: closes when collected, at interpreter exit or on SIGTERM (at_exit.py)
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

        `named_tensors` may be a lazy stream (e.g. ZeRO-3 parameters gathered bucket by bucket);
        then pass `specs` in the same order, so receivers can check the update before it starts.
        Returns when every receiver has consumed it; raises `WeightSyncError` naming the receiver
        that failed, `MismatchError` when a receiver refused the update before any data moved.
        `in_place` is `IpcSender.send`'s; a broadcast moves the bytes either way.
        """
        self._group.check_usable()
        return self._updates.send(named_tensors, self._send_buckets, version, specs)

    def _send_buckets(self, seq, stream) -> bool:
        slots = len(self._group.buffers)
        # (work, the bytes it sends): a bucket sent from its tensor's own memory keeps that
        # tensor alive (a lazy stream may drop it) until its broadcast is done
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
        """End a `send` blocked in another thread (a receiver died): it raises `WeightSyncError`
        with `reason`: at once when it waits for the receivers' reports, within a poll in an
        NCCL transfer (the group is aborted); a gloo transfer ends when the dead receiver's
        connection closes. The sender is unusable afterwards: close it and open a new group."""
        self._group.control.abort(reason)
        self._group.abort(f"aborted: {reason}")

    def close(self, timeout: float = END_SECONDS) -> None:
        """End the stream: each receiver's `receive` returns None. Waits up to `timeout`
        seconds for the receivers to read that (0: not at all; one that calls `receive` after
        the group went gets `WeightSyncError`), then leaves the group. A sender never closed
        does this when it is collected, at interpreter exit or on SIGTERM (see at_exit.py)."""
        at_exit.close_now(self._closer, timeout=timeout, exiting=False)


def _close_sender(
    updates: UpdateSender, group: _Group, timeout: float = END_SECONDS, exiting: bool = True
) -> None:
    """A sender's close. `exiting` (at exit, on SIGTERM): one interrupted inside `send` leaves
    the group as it is (its receivers see the sender go away; the transfer may be in flight)."""
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
        # closed, or its process exits: a sender closing later need not wait for this rank
        self._leave = weakref.finalize(self, leave, self._group.control, self._state)

    def receive(
        self,
        expected: Mapping | None = None,
        cast: bool | torch.dtype = False,
        timeout: float | None = None,
        partial: bool = False,
    ) -> Update | None:
        """Wait for the next update (up to `timeout` seconds; None: as long as the sender lives).
        Returns None once the sender closed: the stream ended (and every later call returns
        None), so `while (update := receiver.receive()) is not None:` is a receiver's loop.

        `expected` (a state dict or name -> TensorSpec) makes the update refuse, before any data
        moves, tensors this receiver does not know or whose shape or dtype differ, and (unless
        `partial`) an update that lacks any of its names. `cast=True` converts to the expected
        dtypes instead; `cast=torch.bfloat16` converts every floating tensor.
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
            if ahead < len(buckets):  # its slot held bucket k-1, already consumed
                post(ahead)
            yield bucket, buffer

    def close(self) -> None:
        self._leave()
        self._group.close()
