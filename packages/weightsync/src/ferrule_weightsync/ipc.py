"""Shared-buffer transport for colocated processes: CUDA IPC on a GPU, shared memory on CPU.

    sender = IpcSender("127.0.0.1", 29700, num_receivers=1, device="cuda:0")
    sender.send(model.named_parameters())

    receiver = IpcReceiver("127.0.0.1", 29700, rank=1, num_receivers=1)
    for name, tensor in receiver.receive(): ...

The sender owns two flat buffers (double buffering) and publishes one handle per buffer. The
receivers map each handle once and keep the mapping, so later updates of the same model exchange
no handles at all. Opening a handle is costly (benchmarks/RESULTS.md): a handle per tensor is
what makes naive IPC slow. For each bucket, the sender packs the bucket and signals "ready".
Each receiver hands out views of the mapped buffer and signals "free" once its consumer has
moved on, which lets the sender reuse the buffer for bucket k+2.

    sender.send(actor.export_weights(), in_place=True)    # a trainer's own memory, on a GPU

In place, nothing is packed. The sender shares the allocations its tensors lie in (for a
trainer, a handful of flat parameter buffers) the same way, once. Each update is then only a
manifest, after which the receivers read the tensors where they lie. The only copy left is each
receiver's own load. A receiver reports done as soon as that load is queued, behind an
interprocess CUDA event whose handle the receiver publishes once. The sender waits on those
events before `send` returns, so the report travels while the copies run.

On CPU the buffers are POSIX shared-memory segments, /dev/shm/ferrule-ws-*. A sender that is
killed outright (SIGKILL, the OOM killer, a container stopped) cannot remove its segments. So
before it creates its own segments, every sender removes those whose creator is gone. Each
creator holds a shared `flock` on its segment for as long as it lives, and the kernel drops the
lock when the creator dies.
"""

import contextlib
import mmap
import os
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping
from multiprocessing import shared_memory
from pathlib import Path

import torch

from ferrule_weightsync import at_exit, messages
from ferrule_weightsync.control import Control
from ferrule_weightsync.errors import MalformedMessageError, PeerTimeoutError, WeightSyncError
from ferrule_weightsync.packing import (
    BucketViews,
    TensorSpec,
    pack,
)
from ferrule_weightsync.update import (
    END_SECONDS,
    MAX_PLACED_BUFFERS,
    LoadsInto,
    ReceiverState,
    Update,
    UpdateSender,
    check_against_specs,
    leave,
    open_update,
)

try:
    import fcntl
except ImportError:  # not POSIX: no /dev/shm either, and the CPU path cannot run
    fcntl = None

DEFAULT_BUCKET_BYTES = 1024 * 2**20  # measured on one H200: 1 GB buckets copy at ~940 GB/s
SEGMENTS = Path("/dev/shm")
CUDA_IPC_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
SPIN_SECONDS = 0.01  # how long a wait for receivers' reads only yields the CPU before sleeping


@contextlib.contextmanager
def _segments_locked() -> Iterator[None]:
    """Let this user's senders in one at a time. Creating and locking a segment, or sweeping
    orphaned ones, is then one step, so a sweep never finds a live sender's segment before its
    lock is taken."""
    fd = os.open(SEGMENTS / f"ferrule-ws.{os.getuid()}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def orphaned_segments(paths: Iterable[Path]) -> Iterator[Path]:
    """Yield the segments in `paths` that belong to this user and that no living process holds
    a lock on (each creator locks its segments while it lives). Each segment is yielded while
    this generator holds its lock."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # removed meanwhile, or another user's
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its creator lives
        except OSError:
            os.close(fd)
            continue
        try:
            yield path
        finally:
            os.close(fd)


def remove_orphaned_segments() -> list[str]:
    """Removes this user's ferrule-ws-* segments that no living process holds a lock on, and
    returns their names. Call with `_segments_locked()` held."""
    removed = []
    for path in orphaned_segments(SEGMENTS.glob("ferrule-ws-*")):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue
        removed.append(path.name)
    return removed


class _SharedBuffer:
    """One flat uint8 buffer other processes can map: CUDA memory or a POSIX shared segment."""

    def __init__(self, nbytes: int, device: torch.device):
        self.shm = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            with _segments_locked():
                remove_orphaned_segments()
                self.shm = shared_memory.SharedMemory(
                    f"ferrule-ws-{uuid.uuid4().hex[:16]}", True, nbytes
                )
                # held until this process closes the segment or dies
                self._lock = os.open(SEGMENTS / self.shm.name, os.O_RDONLY)
                fcntl.flock(self._lock, fcntl.LOCK_SH)
            # If the sender is never closed (dropped, or alive at exit), the segment is removed
            # when this buffer is collected, at interpreter exit or on SIGTERM (at_exit.py). It
            # is not left to the resource tracker's "leaked shared_memory objects" warning, with
            # a GiB of /dev/shm used meanwhile.
            self._removed = at_exit.close_at_exit(self, _remove_segment, self.shm, self._lock)
            self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8)

    @classmethod
    def over(cls, storage: torch.UntypedStorage) -> "_SharedBuffer":
        """Share memory this process already has (the storage of a trainer's parameters) as it
        is. Closing the shared buffer leaves the storage to its owner."""
        shared = cls.__new__(cls)
        shared.shm = None
        shared.tensor = torch.empty(0, dtype=torch.uint8, device=storage.device)
        shared.tensor.set_(storage, 0, (storage.nbytes(),))
        return shared

    def handle(self) -> dict:
        """What a receiver needs to map this buffer, as plain data (JSON)."""
        if self.shm is not None:
            return {"kind": "shm", "name": self.shm.name, "nbytes": self.tensor.numel()}
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        cls, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset = args[
            :10
        ]
        ref_counter, ref_counter_offset, event, event_sync_required = args[11:]
        assert cls is torch.Tensor and dtype == torch.uint8 and tuple(stride) == (1,)
        b64 = messages.to_b64
        return {
            "kind": "cuda", "nbytes": int(size[0]), "offset": offset, "device": device,
            "handle": b64(handle), "storage_bytes": storage_bytes,
            "storage_offset": storage_offset, "ref_counter": b64(ref_counter),
            "ref_counter_offset": ref_counter_offset, "event": b64(event),
            "event_sync_required": event_sync_required,
        }  # fmt: skip

    def close(self) -> None:
        del self.tensor
        if self.shm is not None:
            self.shm.close()
            self._removed()  # unlinks, once


def _remove_segment(shm: shared_memory.SharedMemory, lock: int) -> None:
    """Unlink a segment and drop its creator's lock. The mapping may still be in use, since at
    exit views of it can outlive this call. Unlinking removes only the name; the memory is
    freed with the last mapping."""
    with contextlib.suppress(FileNotFoundError):  # removed meanwhile (another sender's sweep)
        shm.unlink()
    os.close(lock)


class _MappedBuffer:
    """A receiver's mapping of a sender's `_SharedBuffer`."""

    def __init__(self, handle: dict):
        self.mmap = None
        if "name" in handle:
            # Map the segment's file directly rather than through SharedMemory, which (before
            # Python 3.13) registers it with this process's resource tracker and so unlinks it
            # under the sender's feet when the receiver exits.
            with open(f"/dev/shm/{handle['name']}", "r+b") as segment:
                self.mmap = mmap.mmap(segment.fileno(), handle["nbytes"])
            self.tensor = torch.frombuffer(self.mmap, dtype=torch.uint8)
        else:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            # torch's own rebuild, with the classes and layout fixed here: only the numbers
            # and handles come from the sender
            self.tensor = rebuild_cuda_tensor(
                torch.Tensor, (handle["nbytes"],), (1,), handle["offset"],
                torch.storage.TypedStorage, torch.uint8, handle["device"], handle["handle"],
                handle["storage_bytes"], handle["storage_offset"], False,
                handle["ref_counter"], handle["ref_counter_offset"], handle["event"],
                handle["event_sync_required"],
            )  # fmt: skip

    def close(self) -> None:
        del self.tensor
        if self.mmap is not None:
            self.mmap.close()


class IpcSender:
    """Sends named tensors to colocated receivers through two reused shared buffers."""

    def __init__(
        self,
        host: str,
        port: int,
        num_receivers: int,
        device: str | torch.device = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksums: bool = False,
        timeout: float = 120.0,
        connect_timeout: float = 900.0,
        secret: str | bytes | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # to match tensor.device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._control = Control(host, port, 0, num_receivers + 1, timeout, connect_timeout, secret)
        self._control.join()
        self._updates = UpdateSender(self._control, bucket_bytes, checksums)
        self._buffers: list[_SharedBuffer] = []  # the two packing buffers, once needed
        self._shared: list[_SharedBuffer] = []  # in place: the caller's allocations
        self._published: object = None  # what receivers map now: "packed" or the shared key
        self._generation = 0  # incremented at every publication of handles
        self._handles_published = 0
        self._views = BucketViews()
        self._reads_end: dict[int, torch.cuda.Event] = {}  # receiver rank -> its opened event
        # A sender that is never closed ends the stream when collected, at interpreter exit or
        # on SIGTERM (at_exit.py). The shared-memory segments have their own finalizers.
        self._closer = at_exit.close_at_exit(self, _close_sender, self._updates, self._control)

    @property
    def version(self) -> int:
        return self._updates.version

    @property
    def handles_published(self) -> int:
        """How many buffer handles this sender has ever published."""
        return self._handles_published

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        specs: list[TensorSpec] | None = None,
        in_place: bool = False,
    ) -> int:
        """Send one update; same contract as `BroadcastSender.send`.

        `in_place=True` says that the tensors are memory the caller keeps (a trainer's
        parameters) and does not change until `send` returns. On a GPU, if the tensors are
        contiguous on this sender's device and lie in at most MAX_PLACED_BUFFERS allocations,
        the receivers read them where they lie, with no packing copy. The allocations are
        shared on first use, and again whenever one of them changes (each receiver then opens
        new handles). Otherwise the update is packed as usual. If an in-place update is
        aborted, its receivers may have read weights that changed under them afterwards: send
        them a whole update again."""
        self._control.check_open()
        if specs is None and not hasattr(named_tensors, "__len__"):
            named_tensors = list(named_tensors)
        made_here = specs is None  # specs made from these very tensors need no second check
        specs = specs or [TensorSpec.of(name, t) for name, t in named_tensors]
        if in_place and self.device.type == "cuda":
            named_tensors = list(named_tensors)
            if not made_here:
                check_against_specs(named_tensors, specs)
            placed = self._place(named_tensors)
            if placed is not None:
                # receivers read through their own streams: our writes must be done first
                torch.cuda.current_stream(self.device).synchronize()
                return self._updates.send(
                    named_tensors,
                    self._hand_over,
                    version,
                    specs,
                    self._generation,
                    placed,
                    self._await_reads,
                )
        largest = max(spec.nbytes for spec in specs) if specs else 0
        self._ensure_buffers(max(self._updates.bucket_bytes, largest))
        generation = self._generation
        return self._updates.send(named_tensors, self._send_buckets, version, specs, generation)

    def _place(self, named_tensors: list) -> tuple | None:
        """(placement, buffer sizes) if the tensors can be read where they lie, after sharing
        their allocations with the receivers. The allocations are shared again only when they
        change; a trainer's weights stay put from step to step. None if the tensors cannot be
        read in place."""
        found = _allocations([tensor for _, tensor in named_tensors], self.device)
        if found is None:
            return None
        storages, placement = found
        key = tuple((storage.data_ptr(), storage.nbytes()) for storage in storages)
        if self._published != key:
            self._shared = [_SharedBuffer.over(storage) for storage in storages]
            self._publish(self._shared, key)
        return placement, tuple(nbytes for _, nbytes in key)

    def _await_reads(self) -> None:
        """In place: each receiver reports done once its reads of our memory are queued,
        behind an event of its own (whose handle it publishes once). Wait for those events
        here, on the host, so that the caller may change its tensors once `send` returns.
        Because the receivers reported before their copies ended, the report travels while the
        copies run. The events are polled, not waited on in CUDA: a receiver that dies mid-read
        must end the wait with an error within the group's timeout, not hang the trainer."""
        deadline = time.monotonic() + self._control.timeout
        for rank in range(1, self._control.world_size):
            event = self._reads_end.get(rank)
            if event is None:
                key = _reads_end_key(rank)
                if not self._control.has(key):  # the receiver failed before reading anything
                    continue
                handle = self._control.read(key, _event_handle, f"receiver {rank}")
                try:
                    event = torch.cuda.Event.from_ipc_handle(self.device, handle)
                except RuntimeError as err:
                    raise MalformedMessageError(f"control message {key}: {err}") from err
                self._reads_end[rank] = event
            self._poll(event, rank, deadline)

    def _poll(self, event: torch.cuda.Event, rank: int, deadline: float) -> None:
        started = time.monotonic()
        while True:
            try:
                if event.query():
                    return
            except RuntimeError as err:  # the receiver's process and context died mid-read
                raise WeightSyncError(
                    f"receiver {rank}'s reads of the update failed: {err} ({self._control.where})"
                ) from err
            self._control.check_aborted()
            now = time.monotonic()
            if now > deadline:
                raise PeerTimeoutError(
                    f"receiver {rank}'s reads of the update did not end within "
                    f"{self._control.timeout:g}s ({self._control.where})"
                )
            time.sleep(0 if now - started < SPIN_SECONDS else 1e-3)  # a copy is ~1 ms

    def _hand_over(self, seq, stream) -> None:
        """In place: the bytes are already where the receivers read them (synchronised before
        the manifest), so each bucket is only reported as packed."""
        for bucket, _ in stream:
            self._updates.packed(seq, bucket, self._shared[bucket.index].tensor)

    def _ensure_buffers(self, nbytes: int) -> None:
        needed = nbytes + 64  # plan_buckets rounds a bucket up to a multiple of 64 bytes
        if not self._buffers or self._buffers[0].tensor.numel() < needed:
            for buffer in self._buffers:
                buffer.close()
            self._views.clear()
            self._buffers = [_SharedBuffer(needed, self.device) for _ in range(2)]
            self._published = None
        if self._published != "packed":
            self._publish(self._buffers, "packed")

    def _publish(self, buffers: list[_SharedBuffer], what: object) -> None:
        self._generation += 1
        handles = [buffer.handle() for buffer in buffers]
        self._control.publish(f"ipc/handles/{self._generation}", handles)
        self._handles_published += len(handles)
        self._published = what

    def _send_buckets(self, seq, stream) -> None:
        for bucket, tensors in stream:
            if bucket.index >= 2:  # every receiver must be done with bucket k-2 in this slot
                self._control.await_all_signals(seq, bucket.index - 2, "free")
            buffer = self._buffers[bucket.index % 2].tensor[: bucket.nbytes]
            pack(self._views(buffer, bucket), tensors)
            if buffer.is_cuda:  # receivers read through their own streams: the bytes must be there
                torch.cuda.current_stream(buffer.device).synchronize()
            self._updates.packed(seq, bucket, buffer)
            self._control.signal(seq, bucket.index, "ready")

    def abort(self, reason: str) -> None:
        """End a `send` blocked in another thread (a receiver died): it raises `WeightSyncError`
        with `reason` at once. The sender is unusable afterwards: close it and open a new
        group."""
        self._control.abort(reason)

    def close(self, timeout: float = END_SECONDS) -> None:
        """Remove the shared buffers (receivers keep what they mapped) and end the stream, so
        that each receiver's `receive` returns None. Waits up to `timeout` seconds for the
        receivers to read the end (0: no wait). A receiver that calls `receive` after the
        group is gone gets `WeightSyncError`. A sender that is never closed ends the stream
        when it is collected, at interpreter exit or on SIGTERM (see at_exit.py)."""
        for buffer in self._buffers + self._shared:
            buffer.close()
        self._buffers, self._shared = [], []
        at_exit.close_now(self._closer, timeout=timeout, exiting=False)


def _close_sender(
    updates: UpdateSender, control: Control, timeout: float = END_SECONDS, exiting: bool = True
) -> None:
    """Close a sender, except for its buffers (`IpcSender.close` removes those). With
    `exiting` (at exit or on SIGTERM), a sender interrupted inside `send` leaves the group as
    it is, and its receivers see the sender go away."""
    if exiting and updates.sending:
        return
    updates.end(min(control.timeout, timeout))
    control.close()


class IpcReceiver(LoadsInto):
    """A colocated receiver: maps the sender's buffers once and reads updates from them."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        num_receivers: int,
        timeout: float = 120.0,
        connect_timeout: float = 900.0,
        secret: str | bytes | None = None,
    ):
        if not 1 <= rank <= num_receivers:
            raise ValueError(f"receiver rank must be in [1, {num_receivers}], got {rank}")
        self._control = Control(
            host, port, rank, num_receivers + 1, timeout, connect_timeout, secret
        )
        self._control.join()
        self._mapped: list[_MappedBuffer] = []
        self._generation = 0
        self._state = ReceiverState()
        # On close or process exit, tell a sender that closes later not to wait for this rank.
        self._leave = weakref.finalize(self, leave, self._control, self._state)
        self.handles_opened = 0  # for tests and benchmarks: reuse means this stays at 2
        self._reads_end: torch.cuda.Event | None = None  # in place: recorded after our reads

    def receive(
        self,
        expected: Mapping | None = None,
        cast: bool | torch.dtype = False,
        timeout: float | None = None,
        partial: bool = False,
    ) -> Update | None:
        """Wait for the next update; None once the sender closed (the stream ended). Same
        contract as `BroadcastReceiver.receive`."""
        if self._state.ended:
            return None
        return self._open(expected, cast, timeout, partial)

    def _open(self, expected, cast, timeout, partial) -> Update | None:
        return open_update(
            self._control, self._state, self._receive_buckets, expected, cast, timeout,
            partial=partial,
        )  # fmt: skip

    def _map(self, generation: int) -> None:
        if generation == self._generation:
            return
        for mapped in self._mapped:
            mapped.close()
        handles = self._control.read(f"ipc/handles/{generation}", _handles)
        self._state.views.clear()
        self._mapped = [_MappedBuffer(handle) for handle in handles]
        self.handles_opened += len(handles)
        self._generation = generation

    def _receive_buckets(self, seq, layout, manifest):
        self._map(manifest.generation)
        if layout.buffers:
            yield from self._read_in_place(layout)
            return
        for bucket in layout.buckets:
            self._control.await_signal(seq, bucket.index, "ready", "the sender")
            buffer = self._mapped[bucket.index % 2].tensor[: bucket.nbytes]
            yield bucket, buffer
            if buffer.is_cuda:  # our consumer's reads must finish before the sender overwrites
                torch.cuda.current_stream(buffer.device).synchronize()
            self._control.signal_mine(seq, bucket.index, "free")

    def _read_in_place(self, layout):
        """Read an in-place update from the sender's own allocations, one per bucket, where the
        tensors lie. The sender made the bytes ready before it published the manifest, and it
        changes nothing until every receiver has reported done."""
        sizes = [mapped.tensor.numel() for mapped in self._mapped]
        if sizes != list(layout.buffers):
            raise MalformedMessageError(
                f"in-place layout {layout.key}: buffers of {list(layout.buffers)[:4]} bytes, "
                f"the mapped ones have {sizes[:4]}"
            )
        for bucket in layout.buckets:
            yield bucket, self._mapped[bucket.index].tensor
        device = self._mapped[0].tensor.device
        if device.type == "cuda":  # the sender waits for this event before `send` returns
            first = self._reads_end is None
            if first:
                self._reads_end = torch.cuda.Event(interprocess=True)
            self._reads_end.record(torch.cuda.current_stream(device))
            if first:  # publish before our first report, so that the sender finds the handle
                handle = messages.to_b64(self._reads_end.ipc_handle())
                self._control.publish(_reads_end_key(self._control.rank), handle)

    def close(self) -> None:
        self._leave()
        for mapped in self._mapped:
            mapped.close()
        self._mapped = []
        self._control.close()


_SHM_HANDLE = {"kind": messages.text, "name": messages.shm_name, "nbytes": messages.integer}
_CUDA_HANDLE = {
    "kind": messages.text, "nbytes": messages.integer, "offset": messages.integer,
    "device": messages.integer, "handle": messages.text, "storage_bytes": messages.integer,
    "storage_offset": messages.integer, "ref_counter": messages.text,
    "ref_counter_offset": messages.integer, "event": messages.text,
    "event_sync_required": messages.flag,
}  # fmt: skip


def _allocations(tensors: list[torch.Tensor], device: torch.device) -> tuple | None:
    """(the allocations `tensors` lie in, in order of first use; the (allocation, byte offset)
    of each tensor). None unless every tensor is contiguous on `device` and the tensors lie in
    1 to MAX_PLACED_BUFFERS allocations."""
    storages: list[torch.UntypedStorage] = []
    index: dict[int, int] = {}  # a storage's address -> its place in `storages`
    placement = []
    for tensor in tensors:
        if tensor.get_device() != device.index or not tensor.is_contiguous():
            return None
        if not tensor.numel():
            placement.append((0, 0))  # no bytes: anywhere will do
            continue
        where = tensor.data_ptr()
        # the storage's address, without creating its Python object (~1 us per tensor)
        base = where - tensor.storage_offset() * tensor.element_size()
        if base not in index:
            index[base] = len(storages)
            storages.append(tensor.untyped_storage())
        placement.append((index[base], where - base))
    if not storages or len(storages) > MAX_PLACED_BUFFERS:
        return None
    return storages, tuple(placement)


def _reads_end_key(rank: int) -> str:
    """Where receiver `rank` publishes its event's handle (in place, once)."""
    return f"ipc/reads_end/{rank}"


def _event_handle(value: object, key: str) -> bytes:
    return messages.from_b64(value, key, "event handle", CUDA_IPC_HANDLE_BYTES)


def _handles(value: object, key: str) -> list[dict]:
    """Check the buffers' handles: two buffers to pack into, or the allocations of an in-place
    sender. A shared-memory name must be one of ours (never a path). A CUDA handle holds only
    bytes and numbers, which go to torch's rebuild with fixed classes."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_PLACED_BUFFERS:
        raise MalformedMessageError(
            f"control message {key}: expected 1 to {MAX_PLACED_BUFFERS} buffer handles"
        )
    handles = []
    for handle in value:
        kind = handle.get("kind") if isinstance(handle, dict) else None
        if kind not in ("shm", "cuda"):
            raise MalformedMessageError(f"control message {key}: unknown buffer kind {kind!r:.40}")
        handle = messages.fields(handle, key, _SHM_HANDLE if kind == "shm" else _CUDA_HANDLE)
        if handle["nbytes"] > messages.MAX_BUCKET_BYTES:
            raise MalformedMessageError(f"control message {key}: a {handle['nbytes']}-byte buffer")
        if kind == "cuda":
            for name in ("handle", "ref_counter", "event"):
                handle[name] = messages.from_b64(handle[name], key, name)
        handles.append(handle)
    return handles
