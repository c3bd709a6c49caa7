"""Bucket layout, byte packing of every dtype, and the checksum."""

import sys
from pathlib import Path

import pytest
import torch

from ferrule_weightsync.packing import (
    ALIGNMENT,
    BucketViews,
    TensorSpec,
    checksum,
    coalesce,
    copy_all,
    own_bytes,
    pack,
    plan_buckets,
    unpack,
)

sys.path.insert(0, str(Path(__file__).parent))
from peer import realistic_state_dict


def specs_of(state):
    return [TensorSpec.of(name, t) for name, t in state.items()]


def test_layout_keeps_order_aligns_and_never_splits_a_tensor():
    specs = [
        TensorSpec("a", (10,), torch.float32),
        TensorSpec("b", (3,), torch.bfloat16),
        TensorSpec("c", (100,), torch.float32),
        TensorSpec("d", (1,), torch.int64),
        TensorSpec("e", (32,), torch.float32),
        TensorSpec("f", (20,), torch.float32),
        TensorSpec("g", (20,), torch.float32),
    ]
    buckets = plan_buckets(specs, bucket_bytes=256)
    assert [[s.name for s in b.specs] for b in buckets] == [
        ["a", "b"],
        ["c"],  # 400 bytes > 256: its own bucket
        ["d"],
        ["e"],  # 128 bytes, half a bucket: its own bucket, though "d" left room
        ["f", "g"],  # 80 + 80 (at offset 128) fit
    ]
    assert buckets[0].offsets == (0, 64)  # "a" is 40 bytes; "b" starts at the next 64
    assert buckets[1].nbytes == 448  # "c" padded to the alignment
    assert buckets[4].offsets == (0, 128)
    assert all(o % ALIGNMENT == 0 for b in buckets for o in b.offsets)
    assert [b.index for b in buckets] == [0, 1, 2, 3, 4]


def test_bad_bucket_size_is_an_error():
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        plan_buckets([TensorSpec("a", (1,), torch.float32)], 0)


@pytest.mark.parametrize("bucket_bytes", [64, 4096, 1 << 30])
def test_pack_unpack_round_trips_every_dtype_and_layout(bucket_bytes):
    state = realistic_state_dict()
    received = {}
    views = BucketViews()
    for bucket in plan_buckets(specs_of(state), bucket_bytes):
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
        pack(views(buffer, bucket), [state[s.name] for s in bucket.specs])
        received.update((name, t.clone()) for name, t in unpack(views(buffer, bucket), bucket))
    assert list(received) == list(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_unpack_gives_views_not_copies():
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    [bucket] = plan_buckets(specs_of(state), 1024)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    views = BucketViews()
    pack(views(buffer, bucket), [state["w"]])
    [(name, view)] = list(unpack(views(buffer, bucket), bucket))
    buffer.zero_()
    assert name == "w" and torch.equal(view, torch.zeros(2, 3))
    assert views(buffer, bucket)[0] is view  # made once, reused by later updates
    views.clear()
    assert views(buffer, bucket)[0] is not view


def test_a_bucket_of_one_contiguous_tensor_is_sent_from_its_own_memory():
    cpu = torch.device("cpu")
    big = torch.randn(64, 32).to(torch.bfloat16)  # 4096 bytes: a bucket of its own
    small = torch.randn(3)
    (solo,) = plan_buckets(specs_of({"big": big}), bucket_bytes=1024)
    payload = own_bytes([big], solo, cpu)
    assert payload.data_ptr() == big.data_ptr() and payload.numel() == solo.nbytes  # no copy
    assert torch.equal(payload.view(torch.bfloat16).view(64, 32), big)
    # everything else is packed: a transposed tensor, several tensors, a size that is not
    # the bucket's (padding), another device
    assert own_bytes([big.t()], solo, cpu) is None
    (pair,) = plan_buckets(specs_of({"s": small, "t": small}), bucket_bytes=1024)
    assert own_bytes([small, small], pair, cpu) is None
    (padded,) = plan_buckets(specs_of({"s": small}), bucket_bytes=1024)
    assert padded.nbytes == ALIGNMENT and own_bytes([small], padded, cpu) is None
    assert own_bytes([big], solo, torch.device("meta")) is None


def test_tensors_already_laid_out_in_one_buffer_are_sent_from_it():
    """A trainer that gathers straight into a buffer in the sender's layout (plan_buckets at
    the sender's bucket size) needs no packing copy; any tensor out of place, and the bucket
    is packed."""
    cpu = torch.device("cpu")
    state = {"a": torch.randn(3), "b": torch.randn(2, 5).to(torch.bfloat16), "c": torch.randn(7)}
    (bucket,) = plan_buckets(specs_of(state), bucket_bytes=4096)
    buffer = torch.full((bucket.nbytes + 100,), 7, dtype=torch.uint8)  # room to spare
    views = BucketViews()(buffer, bucket)
    pack(views, list(state.values()))
    payload = own_bytes(views, bucket, cpu)
    assert payload.data_ptr() == buffer.data_ptr() and payload.numel() == bucket.nbytes
    assert torch.equal(payload, buffer[: bucket.nbytes])
    moved = BucketViews()(buffer[64:], bucket)  # the same layout, started elsewhere: still whole
    assert own_bytes(moved, bucket, cpu).data_ptr() == buffer.data_ptr() + 64
    assert own_bytes(moved, bucket, cpu).numel() == bucket.nbytes
    # a copy elsewhere, a tensor in the wrong place of the same buffer, a transposed view,
    # a buffer without room for the bucket's padding, another device: packed
    assert own_bytes([views[0], views[1].clone(), views[2]], bucket, cpu) is None
    assert own_bytes([views[0], views[2][:3], views[2]], bucket, cpu) is None
    assert own_bytes([views[0], views[1].t(), views[2]], bucket, cpu) is None
    last = bucket.offsets[-1] + bucket.specs[-1].nbytes
    assert last < bucket.nbytes
    assert (
        own_bytes(BucketViews()(torch.zeros(last, dtype=torch.uint8), bucket), bucket, cpu) is None
    )
    assert own_bytes(views, bucket, torch.device("meta")) is None


def carve(buffer: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of `shapes` one after another in `buffer` (flat), as an engine's flat weights."""
    views, at = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        views.append(buffer[at : at + numel].view(shape))
        at += numel
    return views


def copied(targets, sources) -> list[torch.Tensor]:
    """What `coalesce`'s copies leave in (clones of) the targets."""
    into, frm = coalesce(targets, sources)
    for target, source in zip(into, frm, strict=True):
        target.copy_(source)
    return into


SHAPES = [(3, 5), (7,), (0,), (2, 2, 3), (1,), (11,)]


def test_copies_between_buffers_laid_out_alike_become_one():
    """An engine with its weights in one buffer in the update's order loads them with one
    copy; an empty tensor between two others does not break the run."""
    total = sum(torch.Size(s).numel() for s in SHAPES)
    source = torch.arange(total, dtype=torch.float32) * 0.1  # not exact in binary
    sources = carve(source, SHAPES)
    flat = torch.zeros(total + 5, dtype=torch.float32)  # room after the weights: not copied
    targets = carve(flat[2:], SHAPES)
    into, frm = coalesce(targets, sources)
    assert len(into) == len(frm) == 1 and into[0].numel() == total
    into[0].copy_(frm[0])
    assert torch.equal(flat[2 : 2 + total], source)
    assert flat[:2].eq(0).all() and flat[2 + total :].eq(0).all()
    for target, expected in zip(targets, sources, strict=True):
        assert torch.equal(target, expected)


@pytest.mark.parametrize(
    "breaks",
    ["gap_in_targets", "other_order", "cast", "strided_source", "own_allocations"],
)
def test_copies_merge_only_where_both_sides_continue(breaks):
    """Every way a run can end: the copies that remain still load every tensor exactly."""
    shapes = [(4, 3), (5,), (3, 4), (6,)]
    total = sum(torch.Size(s).numel() for s in shapes)
    source = torch.randn(total, dtype=torch.float64)
    sources = carve(source, shapes)
    targets = carve(torch.zeros(total + 1, dtype=torch.float64), shapes)
    expected_copies = 2
    if breaks == "gap_in_targets":  # the third target one element further on
        flat = torch.zeros(total + 1, dtype=torch.float64)
        targets = carve(flat, shapes[:2]) + carve(flat[1 + 12 + 5 :], shapes[2:])
    elif breaks == "other_order":  # the targets' buffer holds the last two first
        flat = torch.zeros(total, dtype=torch.float64)
        late = carve(flat, shapes[2:])
        targets = carve(flat[18:], shapes[:2]) + late
    elif breaks == "cast":  # an engine in another dtype for two of them: still merged by dtype
        flat32 = torch.zeros(total, dtype=torch.float32)
        targets = carve(flat32, shapes[:2]) + carve(torch.zeros(total), shapes)[2:]
    elif breaks == "strided_source":  # a transposed tensor is copied alone
        sources[2] = sources[2].reshape(4, 3).t()
        expected_copies = 3
    elif breaks == "own_allocations":  # separately allocated targets: one copy each
        targets = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        expected_copies = 4
    into = copied(targets, sources)
    assert len(into) == expected_copies
    for target, expected in zip(targets, sources, strict=True):
        assert torch.equal(target, expected.to(target.dtype))


def test_a_receiver_keeps_its_merged_loads_until_a_target_moves():
    """The merged copies are worked out once per bucket and target set; a parameter whose
    memory is replaced (an engine woken from sleep) makes them be worked out again."""
    from ferrule_weightsync.update import ReceiverState

    total = sum(torch.Size(s).numel() for s in SHAPES)
    sources = carve(torch.arange(total, dtype=torch.float32) / 3, SHAPES)
    params = [torch.nn.Parameter(t, requires_grad=False) for t in carve(torch.zeros(total), SHAPES)]
    state = ReceiverState()
    first = state.loads(sources, list(params))
    assert len(first[0]) == 1 and state.loads(sources, list(params)) is first
    params[1].data = torch.zeros(SHAPES[1])  # the same Parameter, elsewhere now
    into, frm = state.loads(sources, list(params))
    assert len(into) == 3  # before it, itself, after it
    torch._foreach_copy_(into, frm)
    for param, expected in zip(params, sources, strict=True):
        assert torch.equal(param, expected)


def test_large_contiguous_copies_go_alone_and_the_rest_fused(monkeypatch):
    """`copy_all`: a contiguous source of `memcpy_bytes` and up by its own copy (a memcpy on a
    GPU, faster than the fused kernel for a long span), the rest in one fused call, casting
    where the dtypes differ."""
    fused, foreach_copy = [], torch._foreach_copy_
    monkeypatch.setattr(
        torch, "_foreach_copy_", lambda t, s: (fused.append(len(t)), foreach_copy(t, s))
    )
    big, small = torch.randn(40, dtype=torch.float64), torch.randn(3)
    strided = torch.randn(8, 8).t()  # 256 bytes, not contiguous: fused
    targets = [torch.zeros(40, dtype=torch.float64), torch.zeros(3).half(), torch.zeros(8, 8)]
    copy_all(targets, [big, small, strided], memcpy_bytes=256)
    assert fused == [2]
    assert torch.equal(targets[0], big) and torch.equal(targets[1], small.half())
    assert torch.equal(targets[2], strided)


def test_checksum_sees_a_flipped_bit_and_a_swap():
    buffer = torch.randint(0, 255, (1024,), dtype=torch.uint8)
    reference = checksum(buffer)
    flipped = buffer.clone()
    flipped[100] ^= 4
    assert checksum(flipped) != reference
    words = buffer.view(torch.int32).clone()
    words[0], words[1] = 7, 9
    before = checksum(words.view(torch.uint8))
    words[0], words[1] = 9, 7  # swap two adjacent words: the plain sum alone cannot see it
    assert checksum(words.view(torch.uint8)) != before
    assert checksum(buffer.clone()) == reference


def test_digest_is_the_same_exactly_when_the_weights_are():
    from ferrule_weightsync import digest

    weights = {
        "a": torch.arange(6, dtype=torch.float32).view(2, 3),
        "b": torch.tensor(1.5, dtype=torch.bfloat16),  # 0-dim
        "c": torch.tensor([True, False]),
        "d": torch.arange(6, dtype=torch.float32).view(3, 2).t(),  # not contiguous
        "empty": torch.empty(0, 4),
    }
    reference = digest(weights.items())
    assert digest(reversed(list(weights.items()))) == reference  # order does not matter
    assert digest({k: v.clone() for k, v in weights.items()}.items()) == reference
    changed = dict(weights, a=weights["a"].clone())
    changed["a"][1, 2] = torch.nextafter(changed["a"][1, 2], torch.tensor(10.0))  # one ulp
    assert digest(changed.items()) != reference
    assert digest(dict(weights, a=weights["a"].view(3, 2)).items()) != reference  # shape
    assert digest(dict(weights, a=weights["a"].double()).items()) != reference  # dtype
    assert digest({("e" if k == "a" else k): v for k, v in weights.items()}.items()) != reference
    assert digest(dict(weights, empty=torch.empty(4, 0)).items()) != reference
    # The bytes come from the tensor's memory, not from a copy made before it was changed.
    assert digest({"x": torch.zeros(3)}.items()) != digest({"x": torch.ones(3)}.items())


def test_digest_holds_the_host_copy_of_a_device_tensor_while_hashing(monkeypatch):
    """For a GPU tensor `.cpu()` makes a new host tensor, freed as soon as nothing holds it;
    simulated here by a copy. b516c95 hashed through a view of that copy after dropping it, and
    read freed memory (an H100 run caught it: engines' digests no longer matched the policy's)."""
    from ferrule_weightsync import digest

    weights = {
        f"w{i}": torch.randn(1000 + i, generator=torch.Generator().manual_seed(i))
        for i in range(20)
    }
    reference = digest(weights.items())
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *args, **kwargs: self.clone())
    assert digest(weights.items()) == reference
