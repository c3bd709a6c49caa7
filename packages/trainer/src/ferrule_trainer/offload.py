"""Hybrid engine: moves a trained engine's states off the accelerator while the rollout engines
use the accelerator, and moves them back before the next train step.

    offload_states(engine)      # after train_step and the weight export
    ...                         # vLLM generates on the same GPU
    reload_states(engine)       # before the next train_step

ZeRO 1-3 engines use DeepSpeed's own `offload_states` (optimizer states, fp32 master weights,
low-precision weights and gradient buffers to pinned host memory). On the CPU accelerator every
state already lives in host memory, so both calls return at once, and the same loop runs in CI.
"""

from ferrule_trainer.engine import on_cpu


def offload_states(engine) -> None:
    """Moves the engine's states to host memory. It is a no-op on CPU, when the states are
    already offloaded, and when DeepSpeed's ZeRO offload already keeps them on the host."""
    if on_cpu() or getattr(engine, "_ferrule_offloaded", False):
        return
    stage = engine.zero_optimization_stage()
    if stage == 0:
        raise ValueError(
            "offloading between phases needs zero_stage 1, 2 or 3 (DeepSpeed's offload_states); "
            "ZeRO-0 keeps its states in a plain optimizer"
        )
    if engine.zero_offload_optimizer() or engine.zero_offload_param():
        return  # those states already live on the host; DeepSpeed refuses to move them again
    import torch

    engine.offload_states()
    torch.cuda.empty_cache()
    engine._ferrule_offloaded = True


def reload_states(engine) -> None:
    """Moves what `offload_states` moved back onto the accelerator."""
    if on_cpu() or not getattr(engine, "_ferrule_offloaded", False):
        return
    engine.reload_states()
    engine._ferrule_offloaded = False
