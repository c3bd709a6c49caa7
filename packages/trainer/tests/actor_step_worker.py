"""One rank of test_actor_distributed.py: builds an Actor, takes one PPO step, exports weights.

argv: model_path, out_dir, zero_stage, lora_rank. Every rank of WORLD_SIZE takes rows
[rank::WORLD_SIZE] of the same 4 sequences, one micro-batch per row pair, so one process with
two micro-batches and two processes with one each see the same step. Writes the exported
weights (rank 0), a per-tensor gather of the model for comparison and the number of bucket
gathers to out_dir.
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
from ferrule_trainer.batch import Batch
from ferrule_trainer.settings import PolicyLoss

model_path, out_dir, zero_stage, lora_rank = (
    sys.argv[1],
    Path(sys.argv[2]),
    *map(int, sys.argv[3:5]),
)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
actor = Actor(
    model_path, zero_stage=zero_stage, dtype="float32", learning_rate=1e-2, lora_rank=lora_rank
)

generator = torch.Generator().manual_seed(0)
B, T, R = 4, 20, 8
ids = torch.randint(0, 500, (B, T), generator=generator)
attention = torch.ones(B, T, dtype=torch.long)
attention[0, :5] = 0  # left padding of a short prompt
attention[3, -3:] = 0  # right padding of a short response
batch = Batch(ids, attention, attention[:, -R:].clone())
old = actor.logprobs(batch) - 0.05 * torch.randn(B, R, generator=generator)
batch = batch.replace(old_logprobs=old, advantages=torch.randn(B, R, generator=generator))
# rows [rank::world], then micro-batches of 2 / world rows: 1 process x 2 micro-batches of
# 2 rows, or 2 processes x 1 micro-batch of 2 rows
mine = Batch(**{k: v[rank::world] for k, v in vars(batch).items() if v is not None})
micro_batches = mine.split(2)
# an export before the step: the actor's export layout is worked out here, and the one after the
# step below must still read the updated partitions
dict(actor.export_weights(bucket_bytes=64 * 1024))
metrics = actor.train_step(micro_batches, PolicyLoss(clip_low=0.2, clip_high=0.28))

gathers = 0  # collectives of the export: a bucket's (coalesced) all-gathers, GatheredParameters
original_all_gather, original_context = export._all_gather, deepspeed.zero.GatheredParameters


def counting_all_gather(*args, **kwargs):
    global gathers
    gathers += 1
    return original_all_gather(*args, **kwargs)


class CountingContext(original_context):
    def __enter__(self):
        global gathers
        gathers += 1
        return super().__enter__()


export._all_gather = counting_all_gather
deepspeed.zero.GatheredParameters = CountingContext
exported = dict(actor.export_weights(bucket_bytes=64 * 1024))
# The ranks that send nothing only take part (LoRA layers: GatheredParameters on every rank):
# the same collectives, keeping nothing, while rank 0's export is unchanged.
exporting, gathers = gathers, 0
if rank == 0:
    kept = dict(actor.export_weights(bucket_bytes=64 * 1024))
    assert (
        all(torch.equal(kept[n], t) for n, t in exported.items()) and kept.keys() == exported.keys()
    )
else:
    laid_out, foreach_copy = 0, torch._foreach_copy_

    def counting_copy(*args):
        global laid_out
        laid_out += 1
        return foreach_copy(*args)

    torch._foreach_copy_ = counting_copy
    actor.take_part_in_export(bucket_bytes=64 * 1024)
    torch._foreach_copy_ = foreach_copy
    assert laid_out == 0, f"take_part laid out {laid_out} buckets"
assert gathers == exporting, (gathers, exporting)
gathers = exporting
export._all_gather = original_all_gather
deepspeed.zero.GatheredParameters = original_context
specs = actor.weight_specs()
assert [s.name for s in specs] == list(exported), "specs and export disagree on names/order"
for spec in specs:
    assert (
        tuple(exported[spec.name].shape) == spec.shape and exported[spec.name].dtype == spec.dtype
    )

reference = {}  # the model's own weights, gathered one by one (LoRA left unmerged)
for name, param in actor.module.named_parameters():
    with deepspeed.zero.GatheredParameters([param]):
        reference[name] = param.detach().clone()
if rank == 0:
    torch.save(exported, out_dir / "exported.pt")
    torch.save(reference, out_dir / "reference.pt")
    (out_dir / "result.json").write_text(
        json.dumps({"metrics": metrics, "gathers": gathers, "tensors": len(exported)})
    )
torch.save(exported, out_dir / f"exported_rank{rank}.pt")
leave_and_exit()
