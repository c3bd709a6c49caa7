"""The steps of an update that every transport does the same way: announce, check, stream, finish.

A transport (broadcast.py, ipc.py) supplies only its data plane. On the sender, it supplies a
function that moves each packed bucket. On the receiver, it supplies a generator that yields
each bucket as it arrives and frees the bucket when the consumer moves on, and optionally its
own way to tell the sender that the update is done. Everything else lives here, once:
versions, checks against the receiver's expectations, casting, checksums, and telling the
sender who failed.
"""

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice

import torch

from ferrule_weightsync import at_exit, messages
from ferrule_weightsync.control import Control, Manifest
from ferrule_weightsync.errors import MalformedMessageError, MismatchError, WeightSyncError
from ferrule_weightsync.packing import (
    LOAD_MEMCPY_BYTES,
    Bucket,
    BucketViews,
    TensorSpec,
    checksum,
    coalesce,
    copy_all,
    plan_buckets,
)

# A transport's sender side: moves the (bucket, tensors) pairs of update `seq`. It returns whether
# any receiver failed if the transport learns that itself, or None to wait for every "done" report.
SendBuckets = Callable[[int, Iterator[tuple[Bucket, list[torch.Tensor]]]], bool | None]
# A transport's receiver side: yields (bucket, buffer) for update `seq`, and frees each buffer
# when the generator is resumed.
ReceiveBuckets = Callable[[int, "Layout", Manifest], Iterator[tuple[Bucket, torch.Tensor]]]
# A receiver's final report on update `seq`: "" if it consumed everything, else what went wrong.
Finish = Callable[[int, str], None]
MAX_LISTED = 5  # problems listed in one error message
MAX_KEPT_LOADS = 1024  # (buffer, bucket) pairs for which a receiver keeps merged loads
# How long a closing sender waits for receivers to read the end of the stream. It is long enough
# for a receiver that has just loaded the last update to call `receive` again, and short enough
# that closing costs little when the receivers are busy elsewhere (an engine generating).
END_SECONDS = 2.0
LEAVE_SECONDS = 2.0  # how long a receiver that leaves tries to tell the sender


@dataclass(frozen=True)
class Layout:
    """The specs of one update and their buckets. A model sends the same layout every step, so
    the layout is published once (its specs and the bucket size, from which a receiver plans
    the same buckets). Each manifest then names the layout by its key.

    A placed layout (`Layout.placed`) describes tensors that stay where the sender keeps them.
    `buffers` holds the sizes of the sender's own buffers (the trainer's memory, shared once).
    Bucket i holds every tensor that lies in buffer i, and its offsets are where each of those
    tensors lies in the buffer."""

    key: str
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    buffers: tuple[int, ...] = ()  # placed: the size of each buffer in bytes; else empty
    placement: tuple[tuple[int, int], ...] = ()  # placed: (buffer, byte offset) of each spec

    @classmethod
    def plan(cls, key: str, specs: tuple[TensorSpec, ...], bucket_bytes: int) -> "Layout":
        return cls(key, specs, tuple(plan_buckets(list(specs), bucket_bytes)), bucket_bytes)

    @classmethod
    def placed(
        cls,
        key: str,
        specs: tuple[TensorSpec, ...],
        placement: tuple[tuple[int, int], ...],
        buffers: tuple[int, ...],
        bucket_bytes: int,
    ) -> "Layout":
        members: list[list[int]] = [[] for _ in buffers]
        for index, (buffer, _) in enumerate(placement):
            members[buffer].append(index)
        buckets = tuple(
            Bucket(
                buffer,
                tuple(specs[i] for i in indices),
                tuple(placement[i][1] for i in indices),
                nbytes,
            )
            for buffer, (indices, nbytes) in enumerate(zip(members, buffers, strict=True))
        )
        return cls(key, specs, buckets, bucket_bytes, buffers, placement)

    def to_wire(self) -> dict:
        specs = [[s.name, list(s.shape), messages.dtype_name(s.dtype)] for s in self.specs]
        wire = {"bucket_bytes": self.bucket_bytes, "specs": specs}
        if self.buffers:
            wire |= {"buffers": list(self.buffers), "placement": [list(p) for p in self.placement]}
        return wire

    @classmethod
    def from_wire(cls, layout_key: str):
        """The check function that builds a received layout (for Control.read_layout)."""

        def check(value: object, key: str) -> "Layout":
            placed = isinstance(value, dict) and "placement" in value
            checks = {"bucket_bytes": _bucket_bytes, "specs": _specs}
            if placed:
                checks |= {"buffers": _buffer_sizes, "placement": _placement}
            value = messages.fields(value, key, checks)
            if not placed:
                return cls.plan(layout_key, value["specs"], value["bucket_bytes"])
            specs, placement, buffers = value["specs"], value["placement"], value["buffers"]
            _check_placement(specs, placement, buffers, key)
            return cls.placed(layout_key, specs, placement, buffers, value["bucket_bytes"])

        return check


MAX_PLACED_BUFFERS = 4096  # most buffers in one placed layout (at worst, one per parameter)


def _buffer_sizes(value, key, what) -> tuple[int, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_PLACED_BUFFERS:
        raise MalformedMessageError(
            f"control message {key}: {what} must list 1 to {MAX_PLACED_BUFFERS} buffer sizes"
        )
    return tuple(_bucket_bytes(size, key, f"{what}[{i}]") for i, size in enumerate(value))


def _placement(value, key, what) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or len(value) > messages.MAX_TENSORS:
        raise MalformedMessageError(f"control message {key}: {what} must be a list")
    placement = []
    for index, item in enumerate(value):
        if not isinstance(item, list) or len(item) != 2:
            raise MalformedMessageError(
                f"control message {key}: {what}[{index}] is not [buffer, offset]"
            )
        where = f"{what}[{index}]"
        placement.append(
            (
                messages.integer(item[0], key, f"{where} buffer", 0, MAX_PLACED_BUFFERS - 1),
                messages.integer(item[1], key, f"{where} offset", 0, messages.MAX_BUCKET_BYTES),
            )
        )
    return tuple(placement)


def _check_placement(specs, placement, buffers, key: str) -> None:
    """Check that every tensor lies whole inside an existing buffer, aligned for its dtype, and
    that every buffer holds a tensor. So a receiver only ever views memory that it mapped, with
    the sender's dtypes."""
    if len(placement) != len(specs):
        raise MalformedMessageError(
            f"control message {key}: {len(placement)} placements for {len(specs)} tensors"
        )
    used = set()
    for spec, (buffer, offset) in zip(specs, placement, strict=True):
        if buffer >= len(buffers):
            raise MalformedMessageError(
                f"control message {key}: {spec.name!r} placed in buffer {buffer} of {len(buffers)}"
            )
        if offset % spec.dtype.itemsize or offset + spec.nbytes > buffers[buffer]:
            raise MalformedMessageError(
                f"control message {key}: {spec.name!r} ({spec.nbytes} bytes) at offset {offset} "
                f"does not lie aligned inside buffer {buffer} ({buffers[buffer]} bytes)"
            )
        used.add(buffer)
    if len(used) != len(buffers):
        raise MalformedMessageError(f"control message {key}: a buffer holds no tensor")


def _bucket_bytes(value, key, what) -> int:
    return messages.integer(value, key, what, 1, messages.MAX_BUCKET_BYTES)


def _specs(value, key, what) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= messages.MAX_TENSORS:
        raise MalformedMessageError(f"control message {key}: {what} must be a non-empty list")
    specs = []
    for index, item in enumerate(value):
        where = f"{what}[{index}]"
        if not isinstance(item, list) or len(item) != 3:
            raise MalformedMessageError(
                f"control message {key}: {where} is not [name, shape, dtype]"
            )
        spec = TensorSpec(
            messages.text(item[0], key, f"{where} name"),
            messages.shape(item[1], key, f"{where} shape"),
            messages.dtype(item[2], key, f"{where} dtype"),
        )
        if spec.nbytes > messages.MAX_BUCKET_BYTES:
            raise MalformedMessageError(f"control message {key}: {where} is {spec.nbytes} bytes")
        specs.append(spec)
    return tuple(specs)


class ReceiverState:
    """What a receiver keeps between updates: the update counter, known layouts, cached views."""

    def __init__(self):
        self.seq = 0
        self.ended = False  # the sender ended the stream: every later receive returns None
        self.layouts: dict[str, Layout] = {}
        self.views = BucketViews()
        self._loads: dict[int, tuple] = {}

    def loads(self, views: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[list, list]:
        """`coalesce(targets, views)`, kept from one update to the next while the views (cached
        per buffer and bucket) and the targets (the same tensors at the same addresses) do not
        change. Checking that they did not change costs less than coalescing again."""
        ids = tuple(map(id, targets))
        addresses = tuple(target.data_ptr() for target in targets)
        kept = self._loads.get(id(views))
        if kept is None or kept[0] is not views or kept[2] != ids or kept[3] != addresses:
            # Hold the targets too: an id identifies an object only while the object lives.
            kept = (views, targets, ids, addresses, coalesce(targets, views))
            if len(self._loads) >= MAX_KEPT_LOADS:
                self._loads.clear()
            self._loads[id(views)] = kept
        return kept[4]


class UpdateSender:
    """The sender's side of the update protocol, shared by every transport."""

    def __init__(self, control: Control, bucket_bytes: int, checksums: bool):
        self.control, self.bucket_bytes, self.checksums = control, bucket_bytes, checksums
        self.seq = 0
        self.version = 0
        self.layouts: dict[tuple, Layout] = {}
        self.accepted: set[str] = set()  # layout keys every receiver accepted: no handshake
        self.broken = ""  # set when an update fails after data started to move
        self.sending = False  # True inside `send`; a close at exit then leaves the group as is

    def layout(self, specs: list[TensorSpec], placed: tuple | None = None) -> Layout:
        """The layout of these specs, published to the store the first time it is used.
        `placed`: (placement, buffer sizes) of a placed layout."""
        specs = tuple(specs)
        known = self.layouts.get((specs, placed))
        if known is None:
            duplicates = sorted(n for n, c in Counter(s.name for s in specs).items() if c > 1)
            if duplicates:
                raise ValueError(
                    f"tensor names must be unique; repeated: {duplicates[:MAX_LISTED]}"
                )
            key = f"layout{len(self.layouts)}"
            if placed is None:
                known = Layout.plan(key, specs, self.bucket_bytes)
            else:
                known = Layout.placed(key, specs, *placed, self.bucket_bytes)
            self.control.publish_layout(known.key, known.to_wire())
            self.layouts[specs, placed] = known
        return known

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        send_buckets: SendBuckets | None,
        version: int | None,
        specs: list[TensorSpec] | None,
        generation: int = 0,
        placed: tuple | None = None,
        reads_end: Callable[[], None] | None = None,
    ) -> int:
        """`placed` is (placement, buffer sizes) when the tensors stay where the sender keeps
        them; the transport has checked it against the specs. `send_buckets` then gets (bucket,
        None) pairs: there is nothing to move, only the buffers to hand over. `reads_end`, if
        given, is called once every receiver has reported (failed or not); it waits until the
        receivers' reads of the sender's memory have ended."""
        with at_exit.deferring_sigterm():  # the stream ends between updates, not inside one
            self.sending = True
            try:
                return self._send(
                    named_tensors, send_buckets, version, specs, generation, placed, reads_end
                )
            finally:
                self.sending = False

    def _send(self, named_tensors, send_buckets, version, specs, generation, placed, reads_end):
        trusted = specs is None  # specs made from these very tensors need no second check
        if specs is None:
            if not hasattr(named_tensors, "__len__"):
                named_tensors = list(named_tensors)  # holds references only, no copies
            specs = [TensorSpec.of(name, tensor) for name, tensor in named_tensors]
        if not specs:
            raise ValueError("nothing to send: the update has no tensors")
        if self.broken:
            raise WeightSyncError(
                f"{self.control.where} is out of step since {self.broken}; "
                "create a new sender and receivers"
            )
        version = self.version + 1 if version is None else int(version)
        layout = self.layout(specs, placed)
        handshake = layout.key not in self.accepted
        manifest = Manifest(version, layout.key, self.checksums, generation, handshake)
        seq = self.seq
        self.control.publish_manifest(seq, manifest, len(layout.buckets))
        rejected = []
        if handshake:
            rejected = self.control.collect(seq, "ack")
            self.control.decide(seq, rejected)
        self.seq += 1
        if rejected:
            raise MismatchError(f"update to version {version} refused:\n  " + "\n  ".join(rejected))
        if placed is None:
            stream = _bucketed(iter(named_tensors), layout.buckets, check=not trusted)
        else:
            stream = ((bucket, None) for bucket in layout.buckets)
        try:
            any_failed = send_buckets(seq, stream)
        except BaseException as err:
            # receivers are now waiting for buckets that will not come (they time out)
            self.broken = f"update to version {version} failed mid-transfer ({err})"
            raise
        if any_failed is None:
            failed = self.control.collect(seq, "done")
            if reads_end is not None:
                reads_end()
        elif any_failed:  # failed receivers wrote why before they told the transport
            failed = self.control.reported_errors(seq, "done") or ["failed without saying why"]
        else:
            failed = []
        if failed:
            self.accepted.discard(layout.key)  # maybe refused: handshake again next time
            refused = all(": MismatchError: " in message for message in failed)
            kind = MismatchError if refused else WeightSyncError
            raise kind(f"update to version {version} failed:\n  " + "\n  ".join(failed))
        self.accepted.add(layout.key)
        self.version = version
        return version

    def end(self, timeout: float) -> None:
        """Tell the receivers that the stream has ended, so that each one's `receive` returns
        None. Wait up to `timeout` seconds for them to read it, because the group goes away when
        the sender closes. Does nothing after a failure in mid-transfer or an abort: the
        receivers are then out of step (they time out)."""
        if not self.broken and not self.control._aborted:
            self.control.end(self.seq, timeout)

    def packed(self, seq: int, bucket: Bucket, buffer: torch.Tensor) -> None:
        """Transports call this once a bucket is packed: publishes its checksum when enabled."""
        if self.checksums:
            self.control.signal(seq, bucket.index, "checksum", list(checksum(buffer)))


def _bucketed(named_tensors: Iterator, buckets: list[Bucket], check: bool):
    """Group the stream of tensors into buckets. With `check` (the caller announced the specs
    separately), check each tensor against the spec announced for it."""
    for bucket in buckets:
        chunk = list(islice(named_tensors, len(bucket.specs)))
        if len(chunk) < len(bucket.specs):
            raise MismatchError(f"the tensor stream ended before {bucket.specs[len(chunk)].name!r}")
        if check:
            check_against_specs(chunk, bucket.specs)
        yield bucket, [tensor for _, tensor in chunk]


def check_against_specs(chunk: list, specs: tuple[TensorSpec, ...]) -> None:
    for spec, (name, tensor) in zip(specs, chunk, strict=True):
        if (name, tuple(tensor.shape), tensor.dtype) != spec:
            raise MismatchError(
                f"stream tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} does not match "
                f"the announced spec {spec.name!r} {spec.shape} {spec.dtype}"
            )


def expected_specs(expected: Mapping | None) -> dict[str, TensorSpec] | None:
    """Accept a state dict (name -> tensor) or name -> TensorSpec."""
    if expected is None:
        return None
    return {
        name: value if isinstance(value, TensorSpec) else TensorSpec.of(name, value)
        for name, value in expected.items()
    }


def check_specs(
    specs: tuple[TensorSpec, ...],
    expected: dict[str, TensorSpec] | None,
    cast: bool | torch.dtype,
    partial: bool = False,
) -> list[str]:
    """List every way the announced tensors differ from what this receiver can load. Unless
    `partial`, also list the expected names that the update lacks."""
    if expected is None:
        return []
    problems = []
    if not partial:
        sent = {spec.name for spec in specs}
        absent = [name for name in expected if name not in sent]
        if absent:
            problems.append(
                f"{len(absent)} expected tensor(s) not in the update: {absent[:MAX_LISTED]}"
                f"{' ...' if len(absent) > MAX_LISTED else ''} (receive with partial=True to "
                "accept an update of some of them)"
            )
    for spec in specs:
        want = expected.get(spec.name)
        if want is None:
            problems.append(f"tensor {spec.name!r} is not expected by this receiver")
        elif want.shape != spec.shape:
            problems.append(
                f"tensor {spec.name!r}: sender shape {spec.shape}, receiver expects {want.shape}"
            )
        elif want.dtype != spec.dtype and cast is not True:
            problems.append(
                f"tensor {spec.name!r}: sender dtype {spec.dtype}, receiver expects {want.dtype} "
                f"(receive with cast=True to convert)"
            )
    if len(problems) > MAX_LISTED:
        problems = [*problems[:MAX_LISTED], f"... and {len(problems) - MAX_LISTED} more"]
    return problems


class Update:
    """One incoming update. `version` and `specs` are known before any data arrives; iterating
    yields `(name, tensor)` pairs as each bucket lands.

    The tensors are views into a transport buffer, which is refilled once the loop moves past
    their bucket. Load or copy each tensor before advancing: `dict(update)` would keep stale
    views, so use `update.to_state_dict()` instead. Leaving the loop early, or raising inside
    it, still drains the update so that the group stays in step, and tells the sender that
    this receiver failed.
    """

    def __init__(
        self, control, seq, manifest, layout, state, receive_buckets, finish, expected, cast
    ):
        self.control, self.seq, self.manifest, self.layout = control, seq, manifest, layout
        self.version, self.specs = manifest.version, layout.specs
        self._state, self._receive, self._finish = state, receive_buckets, finish
        self._expected, self._cast = expected, cast
        self._started = False

    def _arrivals(self) -> Iterator[tuple[Bucket, torch.Tensor]]:
        if self._started:
            raise WeightSyncError(f"update to version {self.version} was already consumed")
        self._started = True
        return self._receive(self.seq, self.layout, self.manifest)

    def discard(self, error: str) -> None:
        """Take the update off the wire unread, and tell the sender `error`."""
        self._end(self._arrivals(), error)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, views in self._buckets():
            for spec, view in zip(bucket.specs, views, strict=True):
                yield spec.name, self._converted(spec.name, view)

    @torch.no_grad()
    def load_into(
        self, targets: Mapping[str, torch.Tensor], loaded: list[str] | None = None
    ) -> list[str]:
        """Copy every tensor of the update in place into `targets[name]`, cast to the target's
        dtype. This is how an engine loads weights whose names and shapes match the sender's.
        Within a bucket, copies that continue each other on both sides are merged (`coalesce`).
        Spans of LOAD_MEMCPY_BYTES or more are copied by memcpy, the rest in one multi-tensor
        copy. Receive with `expected=targets` to have names and shapes checked before any data
        moves.

        Returns the names loaded. Each bucket's names are appended to `loaded` as the bucket
        lands, so a caller that catches an error knows which targets were replaced. The copies
        are queued on the current stream: synchronise before reading the targets from
        elsewhere."""
        loaded = [] if loaded is None else loaded
        buckets = self._buckets()
        for bucket, views in buckets:
            names = [spec.name for spec in bucket.specs]
            try:
                missing = [name for name in names if name not in targets]
                if missing:
                    raise MismatchError(f"no target for {missing[:MAX_LISTED]}")
                into, sources = self._state.loads(views, [targets[name] for name in names])
                copy_all(into, sources, LOAD_MEMCPY_BYTES)
            except Exception as err:
                buckets.throw(err)  # ends the update, telling the sender why; raises it here
            loaded.extend(names)
        return loaded

    def _buckets(self) -> Iterator[tuple[Bucket, list[torch.Tensor]]]:
        """Yield each landed bucket with views of its tensors. Whatever the consumer does, the
        generator then ends the update: it drains the rest and reports to the sender."""
        arrivals = self._arrivals()
        error = ""
        try:
            for bucket, buffer in arrivals:
                if self.manifest.checksums:
                    self._verify(bucket, buffer)
                yield bucket, self._state.views(buffer, bucket)
        except GeneratorExit:
            error = "the consumer stopped before the end of the update"
            raise
        except BaseException as err:
            error = f"{type(err).__name__}: {err}"
            raise
        finally:
            self._end(arrivals, error)

    def _end(self, arrivals: Iterator, error: str) -> None:
        try:
            for _ in arrivals:  # keep the group in step even when the consumer stopped
                pass
        except WeightSyncError as drain_error:
            error = error or str(drain_error)
        try:
            self._finish(self.seq, error)
        except WeightSyncError:
            if not error:  # nothing else went wrong: losing the sender now is the error
                raise

    def to_state_dict(self) -> dict[str, torch.Tensor]:
        """Receive everything into fresh tensors (safe to keep)."""
        return {name: tensor.clone() for name, tensor in self}

    def _verify(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        sent = self.control.await_signal(
            self.seq, bucket.index, "checksum", "the sender", messages.checksum
        )
        if checksum(buffer) != sent:
            names = [spec.name for spec in bucket.specs]
            raise WeightSyncError(
                f"checksum mismatch in bucket {bucket.index} of version {self.version} "
                f"(tensors {names[:MAX_LISTED]}{' ...' if len(names) > MAX_LISTED else ''})"
            )

    def _converted(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self._cast is True and self._expected is not None:
            return tensor.to(self._expected[name].dtype)
        if isinstance(self._cast, torch.dtype) and tensor.is_floating_point():
            return tensor.to(self._cast)
        return tensor


class LoadsInto:
    """Provides `receive_into`, the same for every receiver; the receiver's own `receive` does
    the transport's part."""

    def receive_into(
        self,
        targets: Mapping[str, torch.Tensor],
        loaded: list[str] | None = None,
        timeout: float | None = None,
    ) -> int | None:
        """Call `receive(expected=targets, cast=True, partial=True)`, then `load_into(targets,
        loaded)`. Returns the version loaded, or None once the stream has ended. An update may
        fill only some of the targets; `loaded` names the ones it filled."""
        update = self.receive(expected=targets, cast=True, timeout=timeout, partial=True)
        if update is None:
            return None
        update.load_into(targets, loaded)
        return update.version


def open_update(
    control: Control,
    state: ReceiverState,
    receive_buckets: ReceiveBuckets,
    expected: Mapping | None,
    cast: bool | torch.dtype,
    timeout: float | None,
    finish: Finish | None = None,
    partial: bool = False,
) -> Update | None:
    """Receiver: wait for the next manifest, check it, and agree with the sender to proceed.
    Returns None once the sender has ended the stream (with its `close`).

    `finish` is the transport's way to report "done" (default: a report through the store).
    With `partial`, an update may lack some expected names."""
    if cast is True and expected is None:
        raise ValueError("cast=True converts to the expected dtypes: pass expected= as well")
    if state.ended:  # the sender, and its store, may be gone
        return None
    seq = state.seq
    manifest = control.read_manifest(seq, timeout)
    if manifest is None:
        state.ended = True
        control.report_end()
        return None
    state.seq += 1
    layout = state.layouts.get(manifest.layout)
    if layout is None:
        check = Layout.from_wire(manifest.layout)
        layout = state.layouts[manifest.layout] = control.read_layout(manifest.layout, check)
    wanted = expected_specs(expected)
    problems = check_specs(layout.specs, wanted, cast, partial)
    finish = finish or functools.partial(_report_done, control)
    update = Update(control, seq, manifest, layout, state, receive_buckets, finish, wanted, cast)
    refusals = ""
    if manifest.handshake:
        control.report(seq, "ack", "\n  ".join(problems))
        refusals = control.await_decision(seq)
    elif problems:
        # This receiver accepted the layout before, so the sender did not wait for its ack.
        # Take the data off the wire so that the group stays in step, and refuse the update in
        # the "done" report.
        update.discard("MismatchError: refused:\n  " + "\n  ".join(problems))
    if problems:
        raise MismatchError(
            f"update to version {manifest.version} refused:\n  " + "\n  ".join(problems)
        )
    if refusals:
        raise MismatchError(
            f"update to version {manifest.version} refused by other receivers:\n  {refusals}"
        )
    return update


def leave(control: Control, state: ReceiverState) -> None:
    """Called when a receiver closes, or when its process exits without a close (through a
    `weakref.finalize`). Tells a sender that closes later not to wait for this rank, if the
    sender can still be reached within a second or two (LEAVE_SECONDS)."""
    if not state.ended:
        with contextlib.suppress(RuntimeError):  # the sender and its store are gone
            control.store.set_timeout(timedelta(seconds=LEAVE_SECONDS))
            control.report_end()


def _report_done(control: Control, seq: int, error: str) -> None:
    control.report(seq, "done", error)
