"""Shared-buffer transport for colocated processes: CUDA IPC on a GPU, shared memory on CPU.

    sender = IpcSender("127.0.0.1", 29700, num_receivers=1, device="cuda:0")
    sender.send(model.named_parameters())

    receiver = IpcReceiver("127.0.0.1", 29700, rank=1, num_receivers=1)
    for name, tensor in receiver.receive(): ...

The sender owns two flat buffers (double buffering) and publishes one handle per buffer; the
receivers map each handle once and keep it, so later updates of the same model exchange no
handles at all (opening a handle is costly, benchmarks/RESULTS.md: a per-tensor handle scheme
is what makes naive IPC slow). Per bucket, the sender packs and signals "ready"; each receiver
hands out views of the mapped buffer and signals "free" once its consumer has moved on, which
lets the sender reuse the buffer for bucket k+2.

    sender.send(actor.export_weights(), in_place=True)    # a trainer's own memory, on a GPU

In place, nothing is packed: the sender shares the allocations its tensors lie in (a trainer's
flat parameter buffers: a handful) the same way, once, and each update is a manifest after which
the receivers read the tensors where they lie. The only copy left is the receivers' own load.
A receiver reports done as soon as that load is queued, behind an interprocess CUDA event whose
handle it publishes once; the sender waits on those events before `send` returns, so the report
travels while the copies run.

On CPU the buffers are POSIX shared-memory segments, /dev/shm/ferrule-ws-*. A sender that is
killed outright (SIGKILL, the OOM killer, a container stopped) cannot remove its segments, so
every sender, before it creates its own, removes those whose creator is gone: each creator holds
a shared `flock` on its segment for as long as it lives, which the kernel drops when it dies.
"""

import contextlib
import mmap
import os
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing import shared_memory
from pathlib import Path

import torch

from ferrule_weightsync import messages
from ferrule_weightsync.control import Control
from ferrule_weightsync.errors import MalformedMessageError, PeerTimeoutError, WeightSyncError
from ferrule_weightsync.packing import (
    LOAD_MEMCPY_BYTES,
    BucketViews,
    TensorSpec,
    coalesce,
    copy_all,
    pack,
)
from ferrule_weightsync.update import (
    END_SECONDS,
    MAX_PLACED_BUFFERS,
    Layout,
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
SPIN_SECONDS = 0.01  # how long a wait for receivers' reads yields the CPU, before it sleeps
CLOSE_SETTLE_SECONDS = 10.0  # how long `close` waits for receivers to take a pushed update


@contextlib.contextmanager
def _segments_locked() -> Iterator[None]:
    """This user's senders one at a time: a segment is created and locked, or swept, as one
    step, so a sweep never finds a live sender's segment before its lock is taken."""
    fd = os.open(SEGMENTS / f"ferrule-ws.{os.getuid()}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def remove_orphaned_segments() -> list[str]:
    """Removes this user's ferrule-ws-* segments that no living process holds a lock on, and
    returns their names. Call with `_segments_locked()` held."""
    removed = []
    for path in SEGMENTS.glob("ferrule-ws-*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # removed meanwhile, or another user's
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its creator lives
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except OSError:
            continue
        finally:
            os.close(fd)
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
            # A sender never closed (dropped, or alive at exit): the segment is removed when
            # this buffer is collected or the interpreter exits, not left to the resource
            # tracker's "leaked shared_memory objects" warning and a GiB of /dev/shm meanwhile.
            self._removed = weakref.finalize(self, _remove_segment, self.shm, self._lock)
            self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8)

    @classmethod
    def over(cls, storage: torch.UntypedStorage) -> "_SharedBuffer":
        """Memory this process already has (the storage of a trainer's parameters), shared as
        it is; closing it leaves the storage to its owner."""
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
    """Unlink a segment and drop its creator's lock. Its mapping may still be in use (at exit,
    views of it can outlive this): unlinking removes the name, the memory goes with the last
    mapping."""
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


class KeptTensors:
    """(name, tensor) pairs that a producer keeps and hands to `IpcSender.send(...,
    in_place=True)` again and again, as a trainer hands over its views of its weights.
    Iterating calls `current()`, the producer's list of pairs: the same list object for as long
    as it holds the very same tensors at the same addresses. The producer re-points none of
    them in place (`set_`, `.data =`) and makes a new list when one would move. A sender that
    meets the same list again skips its own check of every tensor (cache misses, mostly), and
    it iterates only once its likely copies are queued, so that `current()`'s own check runs
    while they do."""

    def __init__(self, current: Callable[[], list[tuple[str, torch.Tensor]]]):
        self._current = current
        self.listed: list | None = None  # what the last iteration went through

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.listed = self._current()
        return iter(self.listed)


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
        if self.device.type == "cuda" and self.device.index is None:  # compared with tensors'
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._control = Control(host, port, 0, num_receivers + 1, timeout, connect_timeout, secret)
        self._control.join()
        self._updates = UpdateSender(self._control, bucket_bytes, checksums)
        self._buffers: list[_SharedBuffer] = []  # the two packing buffers, once needed
        self._shared: list[_SharedBuffer] = []  # in place: the caller's allocations
        self._published: object = None  # what receivers map now: "packed" or the shared key
        self._generation = 0  # bumps at every publication of handles
        self._handles_published = 0
        self._views = BucketViews()
        self._reads_end: dict[int, torch.cuda.Event] = {}  # receiver rank -> its event, opened
        self._last_placed: tuple | None = None  # the last placement, with what it was made of
        self._offering: set[int] = set()  # receivers that offer their own weights (push)
        self._offers: dict[int, _Offer] = {}  # receiver rank -> the weights it offered, mapped
        self._last_pushed: tuple | None = None  # its copies, with what they were made of
        self._written: torch.cuda.Event | None = None  # recorded after our writes (push)
        self.pushes = 0  # for tests and benchmarks: updates written into receivers' weights

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

        `in_place=True` says the tensors are memory the caller keeps (a trainer's parameters)
        and leaves alone until `send` returns. On a GPU, where they lie contiguous on this
        sender's device in at most MAX_PLACED_BUFFERS allocations, the receivers then read them
        there: no packing copy. The allocations are shared on first use and again whenever one
        changes (a handle to open for each receiver); otherwise the update is packed as usual.
        Receivers of an in-place update that is aborted may have read weights that changed
        under them afterwards: send them a whole update again."""
        if specs is None and not hasattr(named_tensors, "__len__"):
            named_tensors = list(named_tensors)
        made_here = specs is None  # specs made from these very tensors need no second check
        specs = specs or [TensorSpec.of(name, t) for name, t in named_tensors]
        if in_place and self.device.type == "cuda":
            claimed = self._claim(specs)
            keeper = named_tensors if isinstance(named_tensors, KeptTensors) else None
            named_tensors = list(named_tensors)  # (a keeper checks its tensors now)
            kept = None if keeper is None else keeper.listed
            if claimed is not None and self._push(
                named_tensors, specs, made_here, *claimed[1:], kept
            ):
                return self._updates.send(
                    named_tensors,
                    None,
                    version,
                    specs,
                    self._generation,
                    *claimed[0],
                    reads_end=self._written.synchronize,  # our copies into their memory
                    pushed=True,
                )
            placed = self._place(named_tensors, specs, checked=made_here)
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

    def _place(self, named_tensors: list, specs: list, checked: bool) -> tuple | None:
        """(placement, buffer sizes) of tensors that can be read where they lie, their
        allocations shared with the receivers; None if they cannot. The same tensors where
        they were last time (a trainer's views of its weights, step after step) are placed as
        then, without checking each again (host time on every update): what the
        receivers read depends only on their names, addresses, shapes, strides and dtypes,
        and an allocation we shared is held, so nothing else can come to lie at its address."""
        names = [name for name, _ in named_tensors]
        marks = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for _, t in named_tensors]
        last = self._last_placed
        made_of = (marks, names, list(specs))
        if last is not None and last[:3] == made_of and last[4] == self._published:
            return last[3]  # (an update packed since then published other buffers)
        if not checked:
            check_against_specs(named_tensors, specs)
        placed = self._place_anew(named_tensors)
        self._last_placed = placed and (*made_of, placed, self._published)
        return placed

    def _place_anew(self, named_tensors: list) -> tuple | None:
        found = _allocations([tensor for _, tensor in named_tensors], self.device)
        if found is None:
            return None
        storages, placement = found
        key = tuple((storage.data_ptr(), storage.nbytes()) for storage in storages)
        if self._published != key:
            self._shared = [_SharedBuffer.over(storage) for storage in storages]
            self._publish(self._shared, key)
        return placement, tuple(nbytes for _, nbytes in key)

    def _claim(self, specs: list) -> tuple | None:
        """Take every receiver's offer of its own tensors for this update, when each made one
        (`IpcReceiver.receive_into`) and took these specs before: (the accepted layout to name,
        as `UpdateSender.accepted_layout` gives it; the offers taken; the copies queued), or
        None (the update then goes the usual way). Where the specs and offers are those of the
        last push, its copies are queued at once, before the tensors are even listed: a
        trainer's export hands over the same views step after step, so they are most likely
        this update's too, and checking the tensors (host time, mostly cache misses) then runs
        while they do. They write nothing that `_push` cannot overwrite: the same names in
        offers we took, read from memory they hold."""
        updates = self._updates
        if updates.checksums or updates.broken or not self._all_offering():
            return None
        accepted = updates.accepted_layout(specs)
        if accepted is None:  # a first update: receivers check its specs first (handshake)
            return None
        offered = {rank: self._take(updates.seq, rank) for rank in self._offering}
        if not all(offered.values()):  # one receives this update the usual way
            return None
        last = self._last_pushed
        if last is None or last[0][1:] != (specs, offered):
            return accepted, offered, None
        _queue(last[2])
        return accepted, offered, last[2]

    def _push(
        self, named_tensors: list, specs: list, checked: bool, offered: dict, queued, kept
    ) -> bool:
        """Write the update straight into the offered tensors (`_claim`): one copy per run of
        memory that continues on both sides, queued on the current stream behind whatever
        last wrote our tensors (and behind `queued`, the last push's copies, unless they are
        this update's). False, with nothing written but `queued`, where a receiver lacks a
        name or has another shape or dtype (the update then goes the usual way, replacing
        every tensor in every receiver)."""
        copies = self._copies(named_tensors, specs, offered, checked, kept)
        if copies is None:
            return False
        if copies is not queued:
            _queue(copies)
        if self._written is None:  # before the first pushed manifest, so receivers find it
            self._written = torch.cuda.Event(interprocess=True)
            self._control.publish(_WRITTEN_KEY, messages.to_b64(self._written.ipc_handle()))
        self._written.record(torch.cuda.current_stream(self.device))
        self.pushes += 1
        return True

    def _all_offering(self) -> bool:
        """Whether every receiver has offered its weights (once they have, they say for every
        update whether they offer them again)."""
        for rank in range(1, self._control.world_size):
            if rank not in self._offering and self._control.has(_offer_key(rank, 1)):
                self._offering.add(rank)
        return len(self._offering) == self._control.world_size - 1

    def _take(self, seq: int, rank: int) -> int:
        """Receiver `rank`'s offer for update `seq`, taken (so it can no longer withdraw it):
        its number, or 0 when it receives this update the usual way. Waits, within the
        group's timeout, for the receiver to say."""
        key = _ready_key(seq, rank)
        known = self._offers.get(rank)
        if known is not None and self._control.swap(
            key, {"offer": known.number}, {"taken": known.number}
        ):
            return known.number  # the offer we expected, taken in one round trip
        deadline = time.monotonic() + self._control.timeout
        while True:
            ((state, number),) = self._control.read(key, _ready, f"receiver {rank}").items()
            if state == "taken":  # by a send that failed before its manifest
                return number
            if state == "offer" and (
                not number or self._control.swap(key, {"offer": number}, {"taken": number})
            ):
                return number
            if time.monotonic() > deadline:  # withdrawn, and not offered again
                raise PeerTimeoutError(
                    f"receiver {rank} withdrew its weights from update {seq} and did not "
                    f"offer them again within {self._control.timeout:g}s ({self._control.where})"
                )
            time.sleep(1e-3)

    def _copies(self, named_tensors: list, specs: list, offered: dict, checked: bool, kept):
        """For each receiver, the copies of the update into its offered weights (merged where
        memory continues on both sides); None if one lacks a name, or has another shape or
        dtype. Kept while the same tensors go to the same offers: the copies hold the memory
        they read and write, so nothing else can come to lie at those addresses, and read it
        through views of their own, so they stay well-formed whatever is done to the tensors
        given (`_claim` queues them before it looks). `kept`: the list a `KeptTensors` went
        through, the same as last time while its keeper's tensors are."""
        last = self._last_pushed
        same_keeping = kept is not None and last is not None and last[3] is kept
        if same_keeping and last[0][1:] == (specs, offered):
            return last[2]
        tensors = [tensor for _, tensor in named_tensors]
        # the same tensor objects (held here) at the same addresses: a trainer's export keeps
        # its views from one step to the next (~0.1 ms for ~300 against ~0.3 comparing shapes
        # and strides too; a tensor's shape changed in place, by resize_ or set_, goes unseen)
        marks = (list(map(id, tensors)), list(map(torch.Tensor.data_ptr, tensors)))
        made_of = (marks, specs, offered)
        if last is not None and last[0] == made_of:
            self._last_pushed = (*last[:3], kept)  # (held: no other list can get its id)
            return last[2]
        if not checked:
            check_against_specs(named_tensors, specs)
        copies = []
        for rank, number in offered.items():
            targets = self._mapped_offer(rank, number)
            into = [targets.get(spec.name) for spec in specs]
            if any(
                t is None or TensorSpec.of(s.name, t) != s for t, s in zip(into, specs, strict=True)
            ):
                return None
            targets, sources = coalesce(into, tensors)
            copies.append((targets, [source.detach() for source in sources]))
        self._last_pushed = (made_of, tensors, copies, kept)
        return copies

    def _mapped_offer(self, rank: int, number: int) -> dict[str, torch.Tensor]:
        """The weights receiver `rank` offered under `number`, mapped here (once per offer)."""
        offer = self._offers.get(rank)
        if offer is None or offer.number != number:
            if offer is not None:
                self._last_pushed = None  # its copies write into the mapping closed here
                offer.close()
            key = _offer_key(rank, number)
            layout, handles = self._control.read(key, _offer, f"receiver {rank}")
            offer = self._offers[rank] = _Offer(number, layout, handles)
        return offer.targets

    def _await_reads(self) -> None:
        """In place: receivers report done once their reads of our memory are queued, each
        behind an event of its own (published once). Wait for those events here, on the host,
        so that the caller may change its tensors when `send` returns: the report then travels
        while the copies run. Polled, not waited on in CUDA: a receiver that dies mid-read must
        end the wait with an error within the group's timeout, not hang the trainer."""
        deadline = time.monotonic() + self._control.timeout
        for rank in range(1, self._control.world_size):
            event = self._reads_end.get(rank)
            if event is None:
                key = _reads_end_key(rank)
                if not self._control.has(key):  # failed before it read anything
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
            except RuntimeError as err:  # its process, and its context, gone mid-read
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
        """In place: the bytes are there already (synchronised before the manifest)."""
        for bucket, _ in stream:
            self._updates.packed(seq, bucket, self._shared[bucket.index].tensor)

    def _ensure_buffers(self, nbytes: int) -> None:
        needed = nbytes + 64  # plan_buckets pads a bucket to 64 bytes
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
        """Remove the shared buffers (receivers keep what they mapped) and end the stream:
        each receiver's `receive` returns None. Waits up to `timeout` seconds for the
        receivers to read that (0: not at all; one that calls `receive` after the group went
        gets `WeightSyncError`)."""
        self._updates.settle(min(self._control.timeout, CLOSE_SETTLE_SECONDS))
        self._last_pushed = None
        for offer in self._offers.values():
            offer.close()
        for buffer in self._buffers + self._shared:
            buffer.close()
        self._buffers, self._shared, self._offers = [], [], {}
        self._updates.end(min(self._control.timeout, timeout))
        self._control.close()


def _queue(copies: list) -> None:
    for targets, sources in copies:
        copy_all(targets, sources, LOAD_MEMCPY_BYTES)


class _Offer:
    """A receiver's offered weights, mapped by the sender: name -> a view of them."""

    def __init__(self, number: int, layout: Layout, handles: list[dict]):
        self.number = number
        self.mapped = [_MappedBuffer(handle) for handle in handles]
        views = BucketViews()
        self.targets = {
            spec.name: view
            for bucket in layout.buckets
            for spec, view in zip(
                bucket.specs, views(self.mapped[bucket.index].tensor, bucket), strict=True
            )
        }

    def close(self) -> None:
        self.targets = {}
        for mapped in self.mapped:
            mapped.close()


class IpcReceiver:
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
        # closed, or its process exits: a sender closing later need not wait for this rank
        self._leave = weakref.finalize(self, leave, self._control, self._state)
        self.handles_opened = 0  # for tests and benchmarks: reuse means this stays at 2
        self._reads_end: torch.cuda.Event | None = None  # in place: marks our reads' end
        self.offers_published = 0  # for tests: how often our weights were shared (push)
        self._offered: tuple | None = (
            None  # the last offer: its marks, allocations, device, tensors
        )
        self._written: torch.cuda.Event | None = None  # the sender's, after its writes (push)

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
        self._decline()
        return self._open(expected, cast, timeout, partial)

    def receive_into(
        self,
        targets: Mapping[str, torch.Tensor],
        loaded: list[str] | None = None,
        timeout: float | None = None,
        offer: bool = True,
    ) -> int | None:
        """Receive the next update into `targets` (name -> tensor, in place): what
        `receive(expected=targets, cast=True, partial=True)` and `load_into(targets, loaded)`
        do (None once the stream ended), and with
        `offer`, on a GPU where the targets lie contiguous in at most MAX_PLACED_BUFFERS
        allocations, less: they are offered to the sender (their allocations shared once,
        again when they move), and a sender of an in-place update with the same names, shapes
        and dtypes writes it into them itself, with no manifest read before the copy. Leave
        the targets alone until this returns; their pending reads on the current stream are
        waited for first. The sender keeps its mapping of offered allocations until a newer
        offer or its close: memory freed meanwhile (an engine's sleep) stays allocated until
        then. Returns the version. On an error after the sender took the offer, `loaded` gets
        every name: the targets may be partly written."""
        loaded = [] if loaded is None else loaded
        if self._state.ended:
            return None
        made = self._offer(targets) if offer else self._decline()
        try:
            update = self._open(targets, True, timeout, True)
        except PeerTimeoutError:
            if made is None or self._control.swap(
                self._ready_key(), made, {"withdrawn": made["offer"]}
            ):
                raise  # not taken: the targets are as they were
            try:  # taken: the sender is writing, and its manifest comes right after
                update = self._open(targets, True, -1.0, True)
            except WeightSyncError:
                loaded.extend(targets)
                raise
        if update is None:
            return None
        try:  # pushed: no data to load, only the sender's writes to wait for
            update.load_into(targets, loaded)
        finally:  # pushed: written, or being written if the wait failed: every name either way
            if update.manifest.pushed:
                loaded.extend(spec.name for spec in update.specs)
        return update.version

    def _open(self, expected, cast, timeout, partial) -> Update | None:
        return open_update(
            self._control, self._state, self._receive_buckets, expected, cast, timeout,
            partial=partial,
        )  # fmt: skip

    def _decline(self) -> None:
        """Receive the next update the usual way, telling a sender that waits for our offers
        (once we made one) not to."""
        if self.offers_published:
            self._control.publish(self._ready_key(), {"offer": 0})

    def _ready_key(self) -> str:
        return _ready_key(self._state.seq, self._control.rank)

    def _offer(self, targets: Mapping[str, torch.Tensor]) -> dict | None:
        """Offer `targets` for the next update, sharing their allocations if they changed;
        the offer made, or None when they cannot be written by the sender."""
        tensors = list(targets.values())
        device = tensors[0].device if tensors else None
        # the same tensor objects (held by the offer) at the same addresses, as in `_copies`
        marks = (list(targets), list(map(id, tensors)), list(map(torch.Tensor.data_ptr, tensors)))
        if self._offered is None or self._offered[0] != marks:
            found = (
                None if device is None or device.type != "cuda" else _allocations(tensors, device)
            )
            if found is None:
                self._offered = None
                return self._decline()
            storages, placement = found
            specs = tuple(TensorSpec.of(name, t) for name, t in targets.items())
            sizes = tuple(storage.nbytes() for storage in storages)
            layout = Layout.placed("offer", specs, placement, sizes, 1)
            shared = [_SharedBuffer.over(storage) for storage in storages]
            self.offers_published += 1
            wire = {"layout": layout.to_wire(), "handles": [b.handle() for b in shared]}
            self._control.publish(_offer_key(self._control.rank, self.offers_published), wire)
            self._offered = (marks, shared, device, tensors)
        torch.cuda.current_stream(self._offered[2]).synchronize()  # our reads of them first
        offer = {"offer": self.offers_published}
        self._control.publish(self._ready_key(), offer)
        return offer

    def _await_writes(self) -> None:
        """Pushed: order our later work on the targets after the sender's writes."""
        device = self._offered[2]
        if self._written is None:
            handle = self._control.read(_WRITTEN_KEY, _event_handle)
            try:
                self._written = torch.cuda.Event.from_ipc_handle(device, handle)
            except RuntimeError as err:
                raise MalformedMessageError(f"control message {_WRITTEN_KEY}: {err}") from err
        torch.cuda.current_stream(device).wait_event(self._written)

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
        if manifest.pushed:
            if self._offered is None:
                raise WeightSyncError(f"update {seq} was written into weights we never offered")
            self._await_writes()
            return
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
        """The sender's own allocations: each bucket is one, read where it lies (the sender
        made the bytes ready before it published the manifest, and changes nothing until every
        receiver reported done)."""
        sizes = [mapped.tensor.numel() for mapped in self._mapped]
        if sizes != list(layout.buffers):
            raise MalformedMessageError(
                f"in-place layout {layout.key}: buffers of {list(layout.buffers)[:4]} bytes, "
                f"the mapped ones have {sizes[:4]}"
            )
        for bucket in layout.buckets:
            yield bucket, self._mapped[bucket.index].tensor
        device = self._mapped[0].tensor.device
        if device.type == "cuda":  # the sender waits for this event before it changes them
            first = self._reads_end is None
            if first:
                self._reads_end = torch.cuda.Event(interprocess=True)
            self._reads_end.record(torch.cuda.current_stream(device))
            if first:  # before our first report, so the sender finds it
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
    """(the allocations `tensors` lie in, in order of first use; (allocation, byte offset)
    of each tensor), or None unless each is contiguous on `device` and they lie in 1 to
    MAX_PLACED_BUFFERS allocations."""
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
        # the storage's address without making its Python object (~1 us a tensor)
        base = where - tensor.storage_offset() * tensor.element_size()
        if base not in index:
            index[base] = len(storages)
            storages.append(tensor.untyped_storage())
        placement.append((index[base], where - base))
    if not storages or len(storages) > MAX_PLACED_BUFFERS:
        return None
    return storages, tuple(placement)


_WRITTEN_KEY = "ipc/written"  # the handle of the sender's event after its writes (push), once


def _offer_key(rank: int, number: int) -> str:
    """Where receiver `rank` publishes its offer `number`: its weights' layout and handles."""
    return f"ipc/offer/{rank}/{number}"


def _ready_key(seq: int, rank: int) -> str:
    """Where receiver `rank` says whether it offers its weights for update `seq`; the sender
    takes the offer there, or the receiver withdraws it, in one step of the store each."""
    return f"u{seq}/ready/{rank}"


def _ready(value: object, key: str) -> dict:
    if not isinstance(value, dict) or len(value) != 1 or not {*value} <= _READY_STATES:
        raise MalformedMessageError(
            f"control message {key}: expected one of {sorted(_READY_STATES)} with its number"
        )
    ((state, number),) = value.items()
    messages.integer(number, key, state)
    return value


_READY_STATES = {"offer", "taken", "withdrawn"}


def _offer(value: object, key: str) -> tuple[Layout, list[dict]]:
    """A receiver's offer, checked like a sender's placed layout (every tensor inside a
    buffer it shares) and its handles like a sender's (CUDA only)."""
    value = messages.fields(value, key, {"layout": messages.mapping, "handles": _any})
    layout = Layout.from_wire("offer")(value["layout"], key)
    handles = _handles(value["handles"], key)
    if not layout.buffers or [h["nbytes"] for h in handles] != list(layout.buffers):
        raise MalformedMessageError(f"control message {key}: the buffers and handles differ")
    if any(handle["kind"] != "cuda" for handle in handles):
        raise MalformedMessageError(f"control message {key}: offers are of CUDA memory only")
    return layout, handles


def _any(value, key, what):
    return value


def _reads_end_key(rank: int) -> str:
    """Where receiver `rank` publishes its event's handle (in place, once)."""
    return f"ipc/reads_end/{rank}"


def _event_handle(value: object, key: str) -> bytes:
    return messages.from_b64(value, key, "event handle", CUDA_IPC_HANDLE_BYTES)


def _handles(value: object, key: str) -> list[dict]:
    """The buffers' handles (two to pack into, or the allocations of an in-place sender),
    checked: a shared-memory name must be one of ours (never a path), CUDA handles are bytes
    and numbers given to torch's rebuild with fixed classes."""
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
