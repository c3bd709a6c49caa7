"""One rank of test_actor_distributed.py's export test: a ZeRO-3 actor over WORLD_SIZE ranks
exports its weights at several bucket sizes, and every rank checks them against DeepSpeed's own
gather of each parameter. With 3 ranks most parameters end in padding (DeepSpeed pads each to a
multiple of the world size), which the export must cut off. argv: model_path, out_dir.
"""

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from rank_exit import leave_and_exit

from ferrule_trainer import export
from ferrule_trainer.actor import Actor
from ferrule_weightsync.packing import own_bytes, plan_buckets

model_path, out_dir = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
actor = Actor(model_path, zero_stage=3, dtype="float32", learning_rate=1e-3)
reference = {}
padded = 0  # parameters whose partitions end in padding
for name, param in actor.module.named_parameters():
    padded += param.ds_numel % int(os.environ["WORLD_SIZE"]) != 0
    with deepspeed.zero.GatheredParameters([param]):
        reference[name] = param.detach().clone()

gathers = 0
original_all_gather = export._all_gather


def counting_all_gather(*args, **kwargs):
    global gathers
    gathers += 1
    return original_all_gather(*args, **kwargs)


export._all_gather = counting_all_gather
end_to_end = export._end_to_end
result = {"padded": padded, "tensors": len(reference), "gathers": {}, "in_place": {}}
for dtype in (None, torch.bfloat16):
    specs = actor.weight_specs(dtype)
    for bucket_bytes in (1, 4096, 64 * 1024, 1 << 30):
        gathers = 0
        # DeepSpeed keeps a rank's partitions end to end, which the export sends as they lie;
        # at one bucket size it is made to join them by copy, as it must where they do not
        export._end_to_end = (lambda _: None) if bucket_bytes == 4096 else end_to_end
        stream = iter(actor.export_weights(dtype, bucket_bytes=bucket_bytes))
        in_place = 0
        buckets = plan_buckets(specs, bucket_bytes)
        for bucket in buckets:
            named = [next(stream) for _ in bucket.specs]
            # laid out as a weightsync sender with this bucket size lays out the bucket
            in_place += own_bytes([t for _, t in named], bucket, torch.device("cpu")) is not None
            for (name, tensor), spec in zip(named, bucket.specs, strict=True):
                assert name == spec.name, (name, spec.name)
                want = reference[name] if dtype is None else reference[name].to(dtype)
                assert torch.equal(tensor, want), (dtype, bucket_bytes, name)
        assert next(stream, None) is None
        key = f"{dtype}/{bucket_bytes}"
        result["gathers"][key], result["in_place"][key] = gathers, [in_place, len(buckets)]
if rank == 0:
    (out_dir / "result.json").write_text(json.dumps(result))
leave_and_exit()
