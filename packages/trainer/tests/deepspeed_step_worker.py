"""One rank of the DeepSpeed smoke test: ZeRO-3 on CPU over gloo, three steps on a kit model.

Run by test_deepspeed_smoke.py with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set;
writes the losses and a checksum of the gathered full weights to <argv[2]>/<rank>.json.
"""

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from rank_exit import leave_and_exit
from transformers import AutoModelForCausalLM

from ferrule_trainer.engine import init_distributed

model_path, out_dir = sys.argv[1], Path(sys.argv[2])
init_distributed()  # gloo, without DeepSpeed's JIT-compiled shared-memory op
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

generator = torch.Generator().manual_seed(rank)
batch = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
losses = []
for _ in range(3):
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())

params = list(engine.module.parameters())
with deepspeed.zero.GatheredParameters(params):
    shard_sizes = [p.ds_tensor.numel() for p in params]
    checksum = sum(float(p.detach().double().abs().sum()) for p in params)
    full_numel = sum(p.numel() for p in params)
result = {
    "losses": losses,
    "checksum": checksum,
    "full_numel": full_numel,
    "shard_numel": sum(shard_sizes),
}
(out_dir / f"{os.environ['RANK']}.json").write_text(json.dumps(result))
leave_and_exit()
