"""One process of test_gpu.py's warm-up test: an Actor with compiled decoder layers, warmed up
first or not (WARM "warm" or "cold"), scores and trains on batches of three lengths, each one
micro-batch of 12k-16k tokens (inductor compiles another graph for a layer below ~10k tokens at
this hidden size: the warm-up is told the step's size); writes the losses and the graphs dynamo
compiled in each step.

    python warm_up_worker.py MODEL_DIR WARM OUT.json
"""

import json
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from ferrule_trainer.actor import Actor
from ferrule_trainer.batch import Batch
from ferrule_trainer.settings import EpochPlan, PolicyLoss

model_dir, warm, out = sys.argv[1], sys.argv[2] == "warm", sys.argv[3]
actor = Actor(model_dir, dtype="bfloat16", learning_rate=1e-4, compile_layers=True, temperature=0.7)
warm_up_compiles = 0
if warm:
    actor.warm_up(16384, packed=False, entropy=True)
    warm_up_compiles = counters["stats"]["unique_graphs"]
generator = torch.Generator().manual_seed(0)
losses, compiles = [], []
for length in (1536, 2048, 1792):
    ids = torch.randint(0, actor.module.config.vocab_size, (8, length), generator=generator)
    attention = torch.ones_like(ids)
    attention[0, :7] = 0  # a shorter prompt
    batch = Batch(ids, attention, attention[:, -512:].clone())
    batch = batch.replace(advantages=torch.randn(8, 512, generator=generator))
    before = counters["stats"]["unique_graphs"]
    batch = batch.replace(old_logprobs=actor.logprobs(batch))
    metrics = actor.train_epochs(
        batch, EpochPlan(micro_batch_size=8), PolicyLoss(entropy_coef=0.01)
    )
    compiles.append(counters["stats"]["unique_graphs"] - before)
    losses.append(metrics["loss"])
Path(out).write_text(
    json.dumps({"losses": losses, "compiles": compiles, "warm_up_compiles": warm_up_compiles})
)
