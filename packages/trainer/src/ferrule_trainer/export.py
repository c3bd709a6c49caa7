"""The trained model's full weights as a stream of (Hugging Face name, tensor) for weightsync.

    specs = weight_specs(engine.module, dtype=torch.bfloat16)        # no communication
    for name, tensor in export_weights(engine.module, dtype=torch.bfloat16):
        ...                                                          # every rank iterates
    exporter = WeightExport(engine.module, torch.bfloat16)           # after every step: the
    sender.send(exporter.weights(), specs=exporter.specs())          # layout worked out once

Names are the ones in the model's Hugging Face checkpoint (`model.layers.0.self_attn.q_proj.weight`),
which vLLM's `load_weights` accepts; tied weights appear once. LoRA adapters are merged into the
base weights (W + B A * scale) on the fly, so inference engines load a plain model and never see
peft names. Under ZeRO-3 the parameters are gathered in buckets of about `bucket_bytes`: each
parameter gathered straight into its own stretch of one bucket buffer (per dtype), the bucket's
all-gathers coalesced into one collective (NCCL and gloo), with none of DeepSpeed's
per-parameter bookkeeping (the join-and-cut export before this one measured 6x faster than
`GatheredParameters` on 2 x H100, benchmarks/weightsync_zero3.py); LoRA layers under ZeRO-3
go through `GatheredParameters`. Every rank of the group must iterate the stream to its end,
since the gathers are collectives. A consumer that pulls bucket k+1 while bucket k is on the wire
(ferrule-weightsync's senders do) overlaps the gather with the transfer. The yielded tensors may
be the (detached) parameters themselves: copy what you keep past the next optimizer step.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ferrule_weightsync import TensorSpec

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


def _nbytes(item: _Item) -> int:
    return sum(int(torch.Size(_full_shape(p)).numel()) * p.dtype.itemsize for p in item.params)


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
    after every step: the list of tensors (a walk over `named_modules`, ~2 ms on a 0.5B model),
    the buckets and each bucket's gather layout are worked out once, on first use. The module's
    structure must not change afterwards (its weights may, and ZeRO-3 partitions are read at
    every export)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype | None = None):
        self.items = _items(module, dtype)
        self.sharded = any(hasattr(p, "ds_id") for item in self.items for p in item.params)
        self._plans: dict[int, list[_BucketPlan]] = {}

    def specs(self) -> list[TensorSpec]:
        """TensorSpecs of the export, in its order; metadata only, so a weightsync sender can
        announce the update before the first gather."""
        return [TensorSpec(item.name, item.shape, item.dtype) for item in self.items]

    def weights(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) for the full model, cast to the dtype (default: as trained).

        Without ZeRO-3 the tensors come straight from the parameters (cast or detached, no
        gather)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if not self.sharded:
            for item in self.items:
                yield item.name, item.compute().to(item.dtype)
            return
        if bucket_bytes not in self._plans:
            self._plans[bucket_bytes] = [
                _BucketPlan(bucket) for bucket in _buckets(self.items, bucket_bytes)
            ]
        for plan in self._plans[bucket_bytes]:
            yield from plan.export()


def weight_specs(module: torch.nn.Module, dtype: torch.dtype | None = None) -> list[TensorSpec]:
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


def _buckets(items: list[_Item], bucket_bytes: int) -> Iterator[list[_Item]]:
    bucket: list[_Item] = []
    used = 0
    for item in items:
        size = _nbytes(item)
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append(item)
        used += size
    if bucket:
        yield bucket


class _BucketPlan:
    """One export bucket under ZeRO-3. A bucket of plain parameters is gathered by
    `_GatherGroup`s (one per dtype); one holding LoRA layers goes through DeepSpeed's
    `GatheredParameters`."""

    def __init__(self, items: list[_Item]):
        self.items = items
        self.plain = all(item.plain is not None for item in items)
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in (item.plain for item in items) if self.plain else ():
            by_dtype.setdefault(param.ds_tensor.dtype, []).append(param)
        self.groups = [_GatherGroup(params) for params in by_dtype.values()]

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.plain:
            full = {}
            for group in self.groups:
                full.update(group.gather())
            for item in self.items:
                yield item.name, full[id(item.plain)].to(item.dtype)  # no copy when it matches
            return
        import deepspeed

        params = list({id(p): p for item in self.items for p in item.params}.values())
        # One all-gather for the whole bucket. The gathered storage is freed when the context
        # exits, so the tensors are copied out before it does.
        with deepspeed.zero.GatheredParameters(params):
            tensors = [(item.name, item.compute().to(item.dtype, copy=True)) for item in self.items]
        yield from tensors


class _GatherGroup:
    """The ZeRO-3 parameters of one dtype in one bucket. Each parameter's partitions are
    gathered straight into its own stretch of one buffer (an all-gather of [world, partition]
    rows: the full flat parameter, padding last), so nothing is packed before the gather or cut
    apart after it; the bucket's all-gathers are one coalesced collective (`_all_gather`). The tensors are views of that buffer, except with one rank, where
    they are views of the partitions themselves."""

    def __init__(self, params: list[torch.nn.Parameter]):
        import torch.distributed as dist

        self.params = params
        self.process_group = params[0].ds_process_group
        self.world = dist.get_world_size(group=self.process_group)
        self.dtype = params[0].ds_tensor.dtype
        self.sizes = [self.world * p.ds_tensor.ds_numel for p in params]
        self.shapes = [(p.ds_numel, p.ds_shape) for p in params]
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else params[0].ds_tensor.device
        )

    def gather(self) -> dict[int, torch.Tensor]:
        """{id(param): its full tensor}."""
        # ds_tensor is read at every export: DeepSpeed may swap it (offload and reload)
        partitions = [p.ds_tensor.reshape(-1) for p in self.params]
        if self.world == 1:  # nothing to gather: each partition is the whole (padded) parameter
            views = partitions
        else:
            if partitions[0].device != self.device:
                partitions = [part.to(self.device) for part in partitions]
            buffer = torch.empty(sum(self.sizes), dtype=self.dtype, device=self.device)
            views = buffer.split(self.sizes)
            _all_gather(views, partitions, self.process_group)
        return {
            id(p): view[:numel].view(shape)
            for p, view, (numel, shape) in zip(self.params, views, self.shapes, strict=True)
        }


def _all_gather(outputs: list[torch.Tensor], inputs: list[torch.Tensor], process_group) -> None:
    """outputs[i] = every rank's inputs[i], rank after rank, as one coalesced collective made
    straight on the process group (NCCL and gloo): what torch's coalescing manager ends in,
    without its Python call per tensor (300+ tensors cost milliseconds of host time that way)."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    # the name from torch 2.13 on, and the one before it
    coalesced = getattr(process_group, "all_gather_single_coalesced", None)
    coalesced = coalesced or process_group.allgather_into_tensor_coalesced
    coalesced(list(outputs), inputs, AllgatherOptions()).wait()
