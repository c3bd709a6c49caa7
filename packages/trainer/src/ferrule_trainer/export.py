"""The trained model's full weights as a stream of (Hugging Face name, tensor) for weightsync.

    specs = weight_specs(engine.module, dtype=torch.bfloat16)        # no communication
    for name, tensor in export_weights(engine.module, dtype=torch.bfloat16):
        ...                                                          # every rank iterates

Names are the ones in the model's Hugging Face checkpoint (`model.layers.0.self_attn.q_proj.weight`),
which vLLM's `load_weights` accepts; tied weights appear once. LoRA adapters are merged into the
base weights (W + B A * scale) on the fly, so inference engines load a plain model and never see
peft names. Under ZeRO-3 the parameters are gathered in buckets of about `bucket_bytes`: each
parameter gathered straight into its own stretch of one bucket buffer (per dtype), the bucket's
all-gathers coalesced into one NCCL call (on gloo they run one by one), with none of DeepSpeed's
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


def weight_specs(module: torch.nn.Module, dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """TensorSpecs of `export_weights(module, dtype)`, in its order; reads metadata only, so a
    weightsync sender can announce the update before the first gather."""
    return [TensorSpec(item.name, item.shape, item.dtype) for item in _items(module, dtype)]


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


def export_weights(
    module: torch.nn.Module,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for the full model, cast to `dtype` (default: as trained).

    Without ZeRO-3 the tensors come straight from the parameters (cast or detached, no gather).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    items = _items(module, dtype)
    sharded = any(hasattr(p, "ds_id") for item in items for p in item.params)
    if not sharded:
        for item in items:
            yield item.name, item.compute().to(item.dtype)
        return
    import deepspeed

    for bucket in _buckets(items, bucket_bytes):
        if all(item.plain is not None for item in bucket):
            full = _gather_partitions([item.plain for item in bucket])
            for item in bucket:
                yield item.name, full[id(item.plain)].to(item.dtype)
            continue
        params = list({id(p): p for item in bucket for p in item.params}.values())
        # One all-gather for the whole bucket. The gathered storage is freed when the context
        # exits, so the tensors are copied out before it does.
        with deepspeed.zero.GatheredParameters(params):
            tensors = [(item.name, item.compute().to(item.dtype, copy=True)) for item in bucket]
        yield from tensors


def _gather_partitions(params: list[torch.nn.Parameter]) -> dict[int, torch.Tensor]:
    """{id(param): its full tensor} for ZeRO-3 parameters. Each parameter's partitions are
    gathered straight into its own stretch of one bucket buffer per dtype (all-gather of
    [world, partition] rows: the full flat parameter, padding last), so nothing is packed before
    the gather or cut apart after it. On NCCL the per-parameter all-gathers of a bucket go as
    one coalesced NCCL call. The tensors are views of that buffer, except with one rank, where
    they are views of the partitions themselves."""
    import torch.distributed as dist

    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in params:
        by_dtype.setdefault(param.ds_tensor.dtype, []).append(param)
    full = {}
    for dtype, group in by_dtype.items():
        process_group = group[0].ds_process_group
        world = dist.get_world_size(group=process_group)
        if world == 1:  # nothing to gather: each partition is the whole (padded) parameter
            for p in group:
                full[id(p)] = p.ds_tensor.reshape(-1)[: p.ds_numel].view(p.ds_shape)
            continue
        here = device or group[0].ds_tensor.device
        buffer = torch.empty(
            world * sum(p.ds_tensor.ds_numel for p in group), dtype=dtype, device=here
        )
        pieces, start = [], 0
        for p in group:
            size = world * p.ds_tensor.ds_numel
            pieces.append((p, buffer[start : start + size], p.ds_tensor.reshape(-1).to(here)))
            start += size
        # all_gather_single is all_gather_into_tensor's newer name (torch 2.13 deprecates the old)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        with _coalesced(process_group, here):
            for _, out, local in pieces:
                gather(out, local, group=process_group)
        for p, out, _ in pieces:
            full[id(p)] = out[: p.ds_numel].view(p.ds_shape)
    return full


def _coalesced(process_group, device: torch.device):
    """A context in which the all-gathers go as one NCCL call (torch's coalescing manager);
    elsewhere (gloo) they run one by one."""
    import contextlib

    import torch.distributed as dist

    coalescing = getattr(dist, "_coalescing_manager", None)
    if device.type != "cuda" or coalescing is None:
        return contextlib.nullcontext()
    return coalescing(group=process_group)  # no device: torch's fast path, one NCCL call
