"""One process of tests/test_gpu.py's masked-rows test: `Actor.train_step` (ZeRO-2, bf16,
compiled layers, checkpointing) on left-padded micro-batches whose padded length is 64 mod 128,
where sdpa's cuDNN backward put NaN into the gradients of fully masked query rows (issue 56).

    python masked_rows_worker.py MODEL_DIR OUT.json
"""

import json
import sys

import torch

from ferrule_trainer.actor import Actor
from ferrule_trainer.batch import Batch

model_dir, out = sys.argv[1], sys.argv[2]
actor = Actor(
    model_dir,
    zero_stage=2,
    dtype="bfloat16",
    learning_rate=1e-6,
    compile_layers=True,
    gradient_checkpointing=True,
)
g = torch.Generator().manual_seed(0)
steps = []
for length in (447, 191, 319):  # model_inputs pads each to 448, 192, 320: 64 mod 128
    rows, response = 8, 64
    ids = torch.randint(5, 500, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):  # prompts of several lengths, left-padded
        mask[row, : 7 * row] = 0
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[::2, -20:] = 0  # and responses that end early
    mask[:, -response:] = response_mask
    advantages = torch.randn(rows, response, generator=g)
    result = actor.train_step([Batch(ids, mask, response_mask, advantages=advantages)])
    steps.append({key: result[key] for key in ("grad_norm", "skipped", "loss")})
    steps[-1]["nonfinite"] = result.get("nonfinite", "")
with open(out, "w") as f:
    json.dump(steps, f)
