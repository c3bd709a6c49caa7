"""Flat byte buckets: packing, unpacking, and the layout both sides compute from the same specs.

Moving one large flat buffer is what makes weight sync fast (one collective or one IPC handle per
bucket, not per tensor). Any dtype is packed as its raw bytes, `tensor.view(torch.uint8)`, and
viewed back on arrival, so bf16, bool and 0-dim tensors need no special cases.

The sender and every receiver call `plan_buckets` on the same specs and bucket size, so the layout
itself never travels; only the specs do.
"""

import ctypes
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

# Offsets are aligned so that every tensor's bytes can be viewed as its dtype (the widest dtype,
# complex128, needs 16 bytes) and so that copies start on cache-line-friendly boundaries.
ALIGNMENT = 64
# Contiguous tensors of this size or larger are packed with a copy of their own (a memcpy)
# instead of going into the fused multi-tensor copy.
MEMCPY_BYTES = 1 << 20
# The same threshold for an engine's load (`Update.load_into`), where nothing else runs beside
# the copy. On an H200 the fused copy moved 1.43 GB in ~1.03 ms and a memcpy in ~0.69 ms, but
# each memcpy costs ~5 us to launch, which a tensor under a few MB does not win back.
LOAD_MEMCPY_BYTES = 64 << 20


class TensorSpec(NamedTuple):
    """What a receiver needs to know about one tensor before its bytes arrive. It is a
    NamedTuple because ~300 specs are hashed and compared on every update, and that must cost
    only microseconds."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """A run of tensors packed back to back (aligned) into one flat buffer of `nbytes`."""

    index: int
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Lay the specs out greedily, in the given order; no tensor is ever split across buckets.
    A tensor of at least half a bucket gets a bucket of its own. Packing it would gain nothing,
    since its transfer is already large, and the sender can send it from its own memory
    instead (`own_bytes`)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    alone_from = (bucket_bytes + 1) // 2
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    offsets: list[int] = []
    used = 0

    def close() -> None:
        nonlocal current, offsets, used
        if current:
            buckets.append(Bucket(len(buckets), tuple(current), tuple(offsets), _align(used)))
        current, offsets, used = [], [], 0

    for spec in specs:
        start = _align(used)
        alone = spec.nbytes >= alone_from
        if current and (alone or start + spec.nbytes > bucket_bytes):
            close()
            start = 0
        current.append(spec)
        offsets.append(start)
        used = start + spec.nbytes
        if alone:
            close()
    close()
    return buckets


class BucketViews:
    """Typed views of each tensor's slot in a reused buffer, made once per (buffer, bucket).

    Making ~300 views costs milliseconds of Python per update. A model sends the same layout
    every step, so the views are made on the first update and reused afterwards. Call `clear()`
    when a buffer is reallocated.
    """

    def __init__(self):
        self._views: dict[tuple[int, int], tuple[Bucket, list[torch.Tensor]]] = {}

    def __call__(self, buffer: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
        # Key by the bucket's identity: hashing its ~300 specs would cost ~0.1 ms per update.
        key = (buffer.data_ptr(), id(bucket))
        cached = self._views.get(key)
        if cached is None or cached[0] is not bucket:  # an id may be reused once freed
            views = [_view(buffer, s, o) for s, o in zip(bucket.specs, bucket.offsets, strict=True)]
            cached = self._views[key] = (bucket, views)
        return cached[1]

    def clear(self) -> None:
        self._views.clear()


def pack(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copy `tensors` into their slots (`BucketViews`). Large contiguous tensors are copied one
    by one with a plain memcpy. On a GPU a memcpy leaves the SMs to a concurrent NCCL
    broadcast, which measured faster than fusing every copy (benchmarks/RESULTS.md). The other
    tensors go in one fused call. Non-contiguous tensors are copied through the strided view,
    without a temporary contiguous copy."""
    copy_all(views, tensors, MEMCPY_BYTES)


@torch.no_grad()  # trainer parameters require grad; the copy must not join their graph
def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor], memcpy_bytes: int) -> None:
    """Run `targets[i].copy_(sources[i])` for every i. A pair gets a copy of its own (a memcpy)
    when the target holds `memcpy_bytes` or more and the source is contiguous, or when the two
    are on different devices. The other pairs go in one fused multi-tensor copy."""
    fused_dst, fused_src = [], []
    for dst, src in zip(targets, sources, strict=True):
        if dst.numel() == 0:
            continue
        if dst.device != src.device or (
            dst.numel() * dst.element_size() >= memcpy_bytes and src.is_contiguous()
        ):
            dst.copy_(src)
        else:
            fused_dst.append(dst)
            fused_src.append(src)
    if fused_dst:
        torch._foreach_copy_(fused_dst, fused_src)


def coalesce(
    targets: list[torch.Tensor], sources: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Turn the copies `targets[i].copy_(sources[i])` into fewer, longer ones. A pair merges
    into the previous one when, on both sides, it starts where the previous pair ended in the
    same allocation and has the same dtype. So an engine whose weights lie in one buffer, in
    the update's order, loads a bucket with one copy (a memcpy if the span is long: see
    LOAD_MEMCPY_BYTES). Empty pairs are dropped."""
    merged_targets: list[torch.Tensor] = []
    merged_sources: list[torch.Tensor] = []
    lengths: list[int] = []
    ends = None  # where the next pair must start on both sides to continue the last one
    for target, source in zip(targets, sources, strict=True):
        numel = target.numel()
        if not numel:
            continue
        here = (_extent(target), _extent(source))
        if (
            here == ends
            and target.dtype == merged_targets[-1].dtype
            and source.dtype == merged_sources[-1].dtype
        ):
            lengths[-1] += numel
        else:
            merged_targets.append(target)
            merged_sources.append(source)
            lengths.append(numel)
        ends = None if None in here else (_past(here[0], target), _past(here[1], source))
    for i, length in enumerate(lengths):
        if length != merged_targets[i].numel():
            merged_targets[i] = _span(merged_targets[i], length)
            merged_sources[i] = _span(merged_sources[i], length)
    return merged_targets, merged_sources


def _extent(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(allocation address, tensor address) for a contiguous tensor; None for any other."""
    if not tensor.is_contiguous():
        return None
    where = tensor.data_ptr()
    return where - tensor.storage_offset() * tensor.element_size(), where


def _past(extent: tuple[int, int], tensor: torch.Tensor) -> tuple[int, int]:
    """(the same allocation address, the address just past the end of `tensor`)."""
    return extent[0], extent[1] + tensor.numel() * tensor.element_size()


def _span(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat view of `numel` elements of `first`'s allocation, starting where `first` starts."""
    return torch.as_strided(first.detach(), (numel,), (1,), first.storage_offset())


def own_bytes(tensors: list[torch.Tensor], bucket: Bucket, device: torch.device):
    """The bucket's bytes, straight from its tensors' memory, if the tensors already lie in one
    buffer on `device` at the bucket's offsets. Examples are a large embedding alone in its
    bucket, or a ZeRO-3 export gathered into a buffer laid out by `plan_buckets` with the same
    bucket size. Sending such a bucket needs no copy. Returns None if the bucket must be
    packed."""
    return lying_in_one_buffer(tensors, bucket.offsets, bucket.nbytes, device)


def lying_in_one_buffer(
    tensors: list[torch.Tensor],
    offsets: list[int],
    nbytes: int,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """`nbytes` bytes of memory (a uint8 tensor, no copy) in which every tensor already lies,
    contiguous, at its byte offset (and on `device`, if given). None if the tensors do not lie
    that way."""
    # empty tensors own no bytes (and may have no address): nothing to check
    placed = [(t, offset) for t, offset in zip(tensors, offsets, strict=True) if t.numel()]
    if not placed:
        return None
    anchor, offset = placed[0]
    storage = anchor.untyped_storage()
    base = anchor.data_ptr() - offset  # where the buffer starts
    start = base - storage.data_ptr()
    if start < 0 or start + nbytes > storage.nbytes():
        return None
    for tensor, offset in placed:
        if (
            (device is not None and tensor.device != device)
            or tensor.data_ptr() != base + offset
            or not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
        ):
            return None
    return torch.empty(0, dtype=torch.uint8, device=anchor.device).set_(storage, start, (nbytes,))


def unpack(views: list[torch.Tensor], bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` views into the buffer: no copy; valid until the buffer is reused."""
    for spec, view in zip(bucket.specs, views, strict=True):
        yield spec.name, view


def _view(buffer: torch.Tensor, spec: TensorSpec, offset: int) -> torch.Tensor:
    return buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def checksum(buffer: torch.Tensor) -> tuple[int, int]:
    """Two sums over the bucket's 32-bit words, computed on the buffer's device (no host copy).
    The plain sum catches corrupted bytes; the sum over the even-indexed words also catches
    most swaps."""
    words = buffer.view(torch.int32)
    return int(words.sum(dtype=torch.int64)), int(words[::2].sum(dtype=torch.int64))


def digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A fingerprint of named tensors that does not depend on their order: sha256 over each
    tensor's name, dtype, shape and bytes. A trainer's export and the weights an engine loaded
    are the same, bit for bit, exactly when their digests match. The tensors are streamed:
    only one tensor at a time is copied to the host."""
    per_tensor = {}
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1)
        h = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        host = flat.view(torch.uint8).cpu()  # a copy if on a GPU; kept alive while hashed
        h.update(_host_bytes(host))
        per_tensor[name] = h.hexdigest()
    total = hashlib.sha256()
    for name in sorted(per_tensor):
        total.update(f"{name}={per_tensor[name]};".encode())
    return total.hexdigest()


def _host_bytes(flat_bytes: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous host uint8 tensor's memory, valid only while the tensor
    lives: the caller must hold a reference until it is done with the view. Through ctypes, not
    numpy: weightsync needs nothing but torch."""
    size = flat_bytes.numel()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * size).from_address(flat_bytes.data_ptr()))
