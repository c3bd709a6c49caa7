"""The trained model's full weights as a stream of (Hugging Face name, tensor) for weightsync.

    specs = weight_specs(engine.module, dtype=torch.bfloat16)        # no communication
    for name, tensor in export_weights(engine.module, dtype=torch.bfloat16):
        ...                                                          # every rank iterates
    exporter = WeightExport(engine.module, torch.bfloat16)           # after every step: the
    sender.send(exporter.weights(), specs=exporter.specs())          # layout is worked out once

Names are the ones in the model's Hugging Face checkpoint
(`model.layers.0.self_attn.q_proj.weight`), which vLLM's `load_weights` accepts; tied weights
appear once. LoRA adapters are merged into the base weights (W + B A * scale) on the fly, so
inference engines load a plain model and never see peft names.

Under ZeRO-3 the parameters are gathered in buckets, laid out as ferrule-weightsync's
`plan_buckets(specs, bucket_bytes)` lays them out. Each bucket takes one all-gather (per dtype)
of each rank's partitions as they lie. Then every piece is moved to its place in one bucket
buffer, which a broadcast sender with the same bucket size sends without packing. None of
DeepSpeed's per-parameter bookkeeping is involved (an earlier export measured 6x faster than
`GatheredParameters` on 2 x H100, benchmarks/weightsync_zero3.py). LoRA layers under ZeRO-3 go
through `GatheredParameters`. Since the gathers are collectives, every rank of the group must
take part: by iterating the stream to its end or, on a rank that sends nothing, by calling
`WeightExport.take_part`, which lays nothing out. A consumer that pulls bucket k+1 while bucket
k is on the wire (as ferrule-weightsync's senders do) overlaps the gather with the transfer. The
yielded tensors may be the (detached) parameters themselves, so copy whatever you keep past the
next optimizer step.
"""

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ferrule_weightsync import Bucket, TensorSpec, lying_in_one_buffer, plan_buckets

# Large enough that a 0.5B model gathers in a handful of collectives, small enough that a bucket
# of gathered full weights fits beside the sharded model.
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


@dataclass
class _Item:
    name: str
    params: list[torch.nn.Parameter]  # everything that must be gathered to compute the tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    compute: Callable[[], torch.Tensor]
    plain: torch.nn.Parameter | None = None  # the tensor is this parameter as it is


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    # Under ZeRO-3 a parameter's own shape is empty; ds_shape is the full one.
    return tuple(getattr(param, "ds_shape", param.shape))


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft wrapper (with the LoRA layers still injected)."""
    if hasattr(module, "peft_config") and hasattr(module, "get_base_model"):
        return module.get_base_model()
    return module


def _lora_item(name: str, layer, dtype: torch.dtype | None) -> _Item:
    weight = layer.get_base_layer().weight
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    for adapter in adapters:
        if layer.use_dora.get(adapter):
            raise NotImplementedError(
                f"{name}: exporting DoRA adapters is not supported, only LoRA"
            )

    def compute() -> torch.Tensor:
        merged = weight.detach().clone()
        if not layer.merged:
            for adapter in adapters:
                # peft's own merge: the same arithmetic as merge_and_unload
                merged += layer.get_delta_weight(adapter).to(merged.dtype)
        return merged

    return _Item(
        f"{name}.weight",
        list(layer.parameters()),
        _full_shape(weight),
        dtype or weight.dtype,
        compute,
    )


def _items(module: torch.nn.Module, dtype: torch.dtype | None) -> list[_Item]:
    """What to export, in named_parameters order: LoRA layers and peft's trainable copies of
    modules (`modules_to_save`) turn into plain Hugging Face names."""
    model = base_model(module)
    special: dict[str, list[_Item]] = {}
    for name, sub in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in special):
            continue
        if hasattr(sub, "lora_A") and hasattr(sub, "get_base_layer"):
            items = [_lora_item(name, sub, dtype)]
            bias = getattr(sub.get_base_layer(), "bias", None)
            if bias is not None:
                items.append(_plain_item(f"{name}.bias", bias, dtype))
            special[name] = items
        elif hasattr(sub, "modules_to_save") and hasattr(sub, "original_module"):
            active = sub.modules_to_save[sub.active_adapters[0]]
            special[name] = [
                _plain_item(f"{name}.{pname}", p, dtype) for pname, p in active.named_parameters()
            ]
    out: list[_Item] = []
    emitted: set[str] = set()
    for pname, param in model.named_parameters():
        prefix = next((p for p in special if pname.startswith(p + ".")), None)
        if prefix is None:
            out.append(_plain_item(pname, param, dtype))
        elif prefix not in emitted:
            emitted.add(prefix)
            out.extend(special[prefix])
    return out


def _plain_item(name: str, param: torch.nn.Parameter, dtype: torch.dtype | None) -> _Item:
    shape, dtype = _full_shape(param), dtype or param.dtype
    return _Item(name, [param], shape, dtype, lambda: param.detach(), plain=param)


class WeightExport:
    """`export_weights` / `weight_specs` of one module at one dtype, for a trainer that exports
    after every step. The list of tensors (a walk over `named_modules`, milliseconds of host
    time), the buckets and each bucket's gather layout are worked out once, on first use. After
    that the module's structure must not change. Its weights may change, since ZeRO-3
    partitions are read at every export."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype | None = None):
        self.items = _items(module, dtype)
        self.sharded = any(hasattr(p, "ds_id") for item in self.items for p in item.params)
        self._plans: dict[int, list[_BucketPlan]] = {}
        # Whether `weights()` yields the module's own memory, with nothing gathered (no ZeRO-3,
        # or ZeRO-3 over one rank), cast or merged. If so, a sender may let receivers read that
        # memory where it lies (ferrule-weightsync's `IpcSender.send(..., in_place=True)`), as
        # long as the module does not change until the send returns.
        self.in_place = all(self._source(item) is not None for item in self.items)
        self._specs = tuple(TensorSpec(item.name, item.shape, item.dtype) for item in self.items)

    def _source(self, item: _Item) -> torch.Tensor | None:
        """The memory that `item`'s tensor is a view of, or None if it is not a view. It is one
        when the item is a plain parameter, already in the export dtype, held whole (under
        ZeRO-3 over one rank: its one partition)."""
        source = item.plain
        if self.sharded and source is not None:
            whole = hasattr(source, "ds_tensor") and _world(source) == 1
            source = source.ds_tensor if whole else None
        return source if source is not None and source.dtype == item.dtype else None

    def _in_place_views(self) -> list[tuple[str, torch.Tensor]]:
        """Every item's tensor where it lies: a view of its parameter, or of its one ZeRO-3
        partition (with one rank, that partition holds the whole parameter)."""
        if self.sharded:
            return [(item.name, _whole(item.plain, item.shape)) for item in self.items]
        return [(item.name, item.plain.detach()) for item in self.items]

    def specs(self) -> tuple[TensorSpec, ...]:
        """The TensorSpecs of the export, in export order. They are metadata only, so a
        weightsync sender can announce the update before the first gather. The same tuple is
        returned every time: a sender compares it with the previous update's specs, and
        identical objects compare at once."""
        return self._specs

    def weights(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) for the full model, cast to the dtype (default: as trained).

        Without ZeRO-3 the tensors come straight from the parameters (cast or detached, no
        gather)."""
        if self.in_place:
            return self._in_place_views()
        return self._exported(bucket_bytes)

    def _exported(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.sharded:
            for item in self.items:
                yield item.name, item.compute().to(item.dtype)
            return
        for plan in self._bucket_plans(bucket_bytes):
            yield from plan.export()

    def take_part(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Takes this rank's part in an export that other ranks (the ones that send) keep; pass
        their `bucket_bytes`. ZeRO-3's gathers need every rank, but a rank that sends nothing
        needs none of the weights, so nothing is laid out here. A no-op without ZeRO-3."""
        if self.sharded:
            for plan in self._bucket_plans(bucket_bytes):
                plan.take_part()

    def _bucket_plans(self, bucket_bytes: int) -> list["_BucketPlan"]:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if bucket_bytes not in self._plans:
            plans, done = [], 0
            for bucket in plan_buckets(self.specs(), bucket_bytes):
                plans.append(_BucketPlan(self.items[done : done + len(bucket.specs)], bucket))
                done += len(bucket.specs)
            self._plans[bucket_bytes] = plans
        return self._plans[bucket_bytes]


def weight_specs(
    module: torch.nn.Module, dtype: torch.dtype | None = None
) -> tuple[TensorSpec, ...]:
    """TensorSpecs of `export_weights(module, dtype)`, in its order; reads metadata only, so a
    weightsync sender can announce the update before the first gather."""
    return WeightExport(module, dtype).specs()


def export_weights(
    module: torch.nn.Module,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for the full model, cast to `dtype` (default: as trained); a
    one-off `WeightExport(module, dtype).weights(bucket_bytes)`."""
    return WeightExport(module, dtype).weights(bucket_bytes)


class _BucketPlan:
    """One export bucket under ZeRO-3, laid out as ferrule-weightsync lays out a bucket of the
    same size (`plan_buckets`). A bucket of plain parameters is gathered by `_GatherGroup`s
    (one per dtype) straight into one buffer in that layout, which a broadcast sender with the
    same bucket size then sends as it is, with no packing copy. A bucket holding LoRA layers
    goes through DeepSpeed's `GatheredParameters`."""

    def __init__(self, items: list[_Item], bucket: Bucket):
        self.items, self.bucket = items, bucket
        self.plain = all(item.plain is not None for item in items)
        by_dtype: dict[tuple, list[int]] = {}
        for index, item in enumerate(items if self.plain else ()):
            by_dtype.setdefault((item.plain.ds_tensor.dtype, item.dtype), []).append(index)
        self.groups = [
            _GatherGroup(
                [items[i].plain for i in indices],
                dtype,
                [bucket.offsets[i] // dtype.itemsize for i in indices],
                bucket.nbytes // dtype.itemsize,
            )
            for (_, dtype), indices in by_dtype.items()
        ]
        self.world = self.groups[0].world if self.groups else 1

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.plain and self.world == 1:
            # nothing to gather: each partition is the whole (padded) parameter
            for item in self.items:
                yield item.name, _whole(item.plain, item.shape).to(item.dtype)  # no copy if same
            return
        if self.plain:
            device = self.groups[0].device
            buffer = torch.empty(self.bucket.nbytes, dtype=torch.uint8, device=device)
            full = {}
            for group in self.groups:
                full.update(group.gather_into(buffer))
            for item in self.items:
                yield item.name, full[id(item.plain)]
            return
        import deepspeed

        # One all-gather for the whole bucket. The gathered storage is freed when the context
        # exits, so the tensors are copied out before it does.
        with deepspeed.zero.GatheredParameters(self._params()):
            tensors = [(item.name, item.compute().to(item.dtype, copy=True)) for item in self.items]
        yield from tensors

    def take_part(self) -> None:
        """Runs the bucket's collectives and keeps nothing."""
        if self.plain and self.world > 1:
            for group in self.groups:
                group.gather()
            # Wait for these gathers before queueing the next bucket's. A gather queued early
            # spins on this rank's GPU until the sending rank joins it, and meanwhile an engine
            # in another process on that GPU (a broadcast's receiver) waits for its time
            # slices. With 512 MB buckets on 2 x H200 the update measured 0.63 of a raw
            # broadcast with the wait, and 0.50-0.51 without it (benchmarks/weightsync_zero3.py).
            # Small buckets, whose broadcasts end within a time slice, lose more by the wait
            # than they gain.
            if self.groups[0].device.type == "cuda":
                torch.cuda.current_stream(self.groups[0].device).synchronize()
        elif not self.plain:
            import deepspeed

            with deepspeed.zero.GatheredParameters(self._params()):
                pass

    def _params(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for item in self.items for p in item.params}.values())


class _GatherGroup:
    """The ZeRO-3 parameters of one bucket that share a partition dtype and an export dtype.

    Each group takes one all-gather. Each rank's partitions, end to end (as DeepSpeed keeps
    them, else joined by one copy), are gathered rank after rank. Then one multi-tensor copy
    moves every rank's piece of every parameter to its place in the bucket buffer, cutting off
    DeepSpeed's padding and casting if the dtypes differ. The buffer is laid out as
    ferrule-weightsync's sender lays out the bucket, so the sender broadcasts it as it is. (The
    per-parameter gathers used before this, in one coalesced call, went into a layout of their
    own, which the sender then copied into its bucket.) Where the pieces go is worked out once.
    The buffer is new at every export, because a consumer may keep a bucket's tensors while the
    next bucket is gathered."""

    def __init__(self, params, dtype: torch.dtype, starts: list[int], length: int):
        self.params, self.dtype = params, dtype
        self.process_group = params[0].ds_process_group
        self.world = _world(params[0])
        self.partition_dtype = params[0].ds_tensor.dtype
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else params[0].ds_tensor.device
        )
        parts = [p.ds_tensor.ds_numel for p in params]
        numels = [p.ds_numel for p in params]
        self.row = sum(parts)
        self.shapes = [p.ds_shape for p in params]
        # rank r holds elements [r * part, (r + 1) * part) of each flat parameter, and the last
        # elements are padding; rank r's piece of the parameter proper is `size` elements long
        pieces = [
            [
                (p, min(part, max(0, numel - r * part)))
                for p, (part, numel) in enumerate(zip(parts, numels, strict=True))
            ]
            for r in range(self.world)
        ]
        # a row, split into (piece, padding) pairs; the pieces are the even entries
        self.row_splits = [
            [n for p, size in mine for n in (size, parts[p] - size)] for mine in pieces
        ]
        self.keep = [[2 * p for p, size in mine if size] for mine in pieces]
        # the bucket buffer (in `dtype` elements), split into the gap before each parameter,
        # that parameter's pieces rank after rank, and the rest at the end; `places` holds the
        # split indices of the pieces, in row order
        splits = []
        index_of = {}
        cursor = 0
        for p, start in enumerate(starts):  # in bucket order already
            splits.append(start - cursor)
            for r in range(self.world):
                index_of[p, r] = len(splits)
                splits.append(pieces[r][p][1])
            cursor = start + numels[p]
        splits.append(length - cursor)
        self.buffer_splits = splits
        self.places = [index_of[p, r] for r in range(self.world) for p, size in pieces[r] if size]
        self.starts, self.numels = starts, numels

    def _row(self) -> torch.Tensor:
        """This rank's partitions of the group, end to end: a view where they already lie end to
        end in memory (DeepSpeed keeps them in one flat buffer, in parameter order), else a
        copy."""
        # ds_tensor is read at every export: DeepSpeed may swap it (offload and reload)
        partitions = [p.ds_tensor.reshape(-1) for p in self.params]
        row = _end_to_end(partitions)
        if row is None:
            row = torch.cat(partitions)
        return row if row.device == self.device else row.to(self.device)

    def gather(self) -> torch.Tensor:
        """The all-gather alone: every rank's row, rank after rank, with nothing laid out."""
        rows = torch.empty(self.world * self.row, dtype=self.partition_dtype, device=self.device)
        _all_gather(rows, self._row(), self.process_group)
        return rows

    def gather_into(self, buffer: torch.Tensor) -> dict[int, torch.Tensor]:
        """Gathers the group into `buffer` (the bucket's bytes). Returns {id(param): the
        parameter's full tensor, a view of `buffer`}."""
        rows = self.gather()
        sources = [
            piece
            for r, mine in enumerate(rows.split(self.row))
            for piece in _pick(mine.split(self.row_splits[r]), self.keep[r])
        ]
        typed = buffer.view(self.dtype)
        targets = _pick(typed.split(self.buffer_splits), self.places)
        if targets:
            torch._foreach_copy_(targets, sources)
        return {
            id(param): typed[start : start + numel].view(shape)
            for param, start, numel, shape in zip(
                self.params, self.starts, self.numels, self.shapes, strict=True
            )
        }


def _end_to_end(partitions: list[torch.Tensor]) -> torch.Tensor | None:
    """The (flat) partitions as one flat tensor, without a copy, when they lie one right after
    another in one storage; else None."""
    offsets = list(itertools.accumulate((p.nbytes for p in partitions), initial=0))
    span = lying_in_one_buffer(partitions, offsets[:-1], offsets[-1])
    return None if span is None else span.view(partitions[0].dtype)


def _whole(param: torch.nn.Parameter, shape: tuple[int, ...]) -> torch.Tensor:
    """A ZeRO-3 parameter of one rank as a whole tensor: a view of its one partition, without
    the padding."""
    return param.ds_tensor.detach().reshape(-1)[: param.ds_numel].view(shape)


def _world(param: torch.nn.Parameter) -> int:
    """How many ranks a ZeRO-3 parameter is partitioned over."""
    import torch.distributed as dist

    return dist.get_world_size(group=param.ds_process_group)


def _pick(pieces, indices: list[int]) -> list[torch.Tensor]:
    return [pieces[i] for i in indices]


def _all_gather(output: torch.Tensor, row: torch.Tensor, process_group) -> None:
    """output = every rank's row, rank after rank (NCCL and gloo)."""
    import torch.distributed as dist

    # all_gather_single is the name from torch 2.13 on (the GPU machines have 2.11), and
    # all_gather_into_tensor the name before it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, row, group=process_group)
