"""One rank of test_actor_distributed.py's uneven test: ranks whose token budgets give them
different numbers of micro-batches score and train on their rows as one process does on all.

argv: model_path, out_dir, zero_stage. WORLD_SIZE 1 takes all 6 rows; of 2, rank 0 takes the
three long rows (two micro-batches of the 40-token budget) and rank 1 the three short ones
(one). Writes this rank's log-probabilities (before the step) and the step's metrics.
"""

import json
import os
import sys
from pathlib import Path

import torch
from rank_exit import leave_and_exit

from ferrule_trainer.actor import Actor
from ferrule_trainer.batch import Batch
from ferrule_trainer.settings import EpochPlan, ForwardPlan, PolicyLoss

model_path, out_dir, zero_stage = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
actor = Actor(model_path, zero_stage=zero_stage, dtype="float32", learning_rate=1e-2)

generator = torch.Generator().manual_seed(0)
B, T, R = 6, 20, 8
ids = torch.randint(0, 500, (B, T), generator=generator)
attention = torch.ones(B, T, dtype=torch.long)
attention[3:, :8] = 0  # rows 3-5: 4-token prompts
attention[3:, -4:] = 0  # and 4-token responses
batch = Batch(ids, attention, attention[:, -R:].clone())
batch = batch.replace(advantages=torch.randn(B, R, generator=generator))
mine = batch if world == 1 else batch.take([0, 1, 2] if rank == 0 else [3, 4, 5])
logprobs = actor.logprobs(mine, ForwardPlan(micro_batch_size=8, micro_batch_tokens=40))
plan = EpochPlan(micro_batch_size=8, micro_batch_tokens=40)
metrics = actor.train_epochs(mine, plan, PolicyLoss())
torch.save(logprobs, out_dir / f"logprobs_rank{rank}.pt")
if rank == 0:
    (out_dir / "metrics.json").write_text(json.dumps(metrics))
leave_and_exit()
