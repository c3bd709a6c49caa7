"""One process of test_gpu.py: train a small Qwen2 on one GPU and report losses, memory and
weights. MODE is "plain", "hybrid" (every state moved to host memory between steps and back, as
around a rollout phase), "cpu-states" (DeepSpeed's offload_optimizer, and offload_params under
ZeRO-3: the states live in host memory and the optimizer step runs on the CPU) or "compiled"
(the decoder layers through torch.compile). The steps' batches differ in length, as packed
micro-batches do.

    python gpu_hybrid_worker.py MODEL_DIR ZERO_STAGE MODE OUT.json
"""

import json
import sys
from pathlib import Path

import torch

from ferrule_trainer import engine
from ferrule_trainer.batch import SequenceBatch
from ferrule_trainer.export import export_weights
from ferrule_trainer.offload import offload_states, reload_states
from ferrule_trainer.sft import sft_loss

model_dir, stage, mode, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
offload = mode == "hybrid"
cpu_states = (
    {"offload_optimizer": True, "offload_params": stage == 3} if mode == "cpu-states" else {}
)
engine.init_distributed()  # a group of one, NCCL
config = engine.deepspeed_config(zero_stage=stage, dtype="bfloat16", **cpu_states)
model = engine.load_model(
    model_dir, dtype="bfloat16", ds_config=config, compile_layers=mode == "compiled"
)
ds = engine.build_engine(model, learning_rate=1e-3, ds_config=config)

# one batch, learned by heart: the loss must fall
ids = torch.randint(
    0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0)
)
ones = torch.ones_like(ids)
losses, resident, after_offload, after_reload = [], [], [], []
for length in (128, 96, 112, 128):
    batch = SequenceBatch(ids[:, :length], ones[:, :length], ones[:, :length]).to("cuda")
    count = batch.loss_mask[:, 1:].sum().double()
    metrics = engine.optimizer_step(
        ds, [batch], lambda mb, count=count: (sft_loss(ds, mb, count), {})
    )
    losses.append(metrics["loss"])
    torch.cuda.synchronize()
    resident.append(torch.cuda.memory_allocated())
    if offload:  # the rollout phase would use the GPU here
        offload_states(ds)
        after_offload.append(torch.cuda.memory_allocated())
        reload_states(ds)
        after_reload.append(torch.cuda.memory_allocated())

weights = {name: tensor.float().cpu() for name, tensor in export_weights(ds.module)}
torch.save(weights, out + ".pt")
Path(out).write_text(
    json.dumps(
        {
            "losses": losses,
            "resident": resident,
            "after_offload": after_offload,
            "after_reload": after_reload,
        }
    )
)
