"""Non-finite gradients: where a skipped step's NaN or inf came from, and when to stop skipping.

    where = locate(engine, micro_batches, loss_fn)   # after a skipped step, on every rank
    guard = SkippedSteps(limit=3, role="policy")
    guard.count(step, metrics)   # raises NonFiniteGradientError at `limit` skips in a row

`engine.optimizer_step` skips an update whose gradients hold a NaN or an inf, so no weight,
optimizer state or learning-rate schedule changes. It then asks `locate` where the bad values
came from. `locate` replays the step's micro-batches one at a time, each forward and backward
outside DeepSpeed's gradient hooks, to find the first micro-batch whose gradients are not finite
and the parameters those gradients reach.
"""

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

DEFAULT_LIMIT = 3  # skipped steps in a row that stop a run ([trainer] max_skipped_steps)

# Advice for the message that a stopped run gives: which fix helps against which cause.
ADVICE = (
    "a NaN that a finite loss gives is a kernel's (try [model] compile_layers = false, or "
    "another attn_implementation); an inf from large updates calls for a lower learning_rate, "
    "a lower max_grad_norm or an importance-sampling cap (is_cap)"
)


class NonFiniteGradientError(FloatingPointError):
    """Gradients held NaN or inf at `limit` optimizer steps in a row, each skipped."""


def locate(engine, micro_batches: Sequence[Any], loss_fn: Callable) -> str:
    """Describes in words where the non-finite gradients arise ("" when replaying the step's
    micro-batches gives finite gradients). Every rank of the group calls it; with several ranks
    the answers are gathered, and the result lists each rank's non-empty answer. Under ZeRO-3
    nothing is replayed, since each forward gathers parameters in step with the other ranks and
    the parameters hold only this rank's shard."""
    own = "" if engine.zero_optimization_stage() == 3 else _replay(engine, micro_batches, loss_fn)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return own
    each: list[str] = [""] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(each, own)
    return "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(each) if text)


@contextlib.contextmanager
def _plain_forward(engine):
    """Inside this context, calling `engine` runs only its module. DeepSpeed's own forward hooks
    the outputs so that any backward through them enters DeepSpeed's gradient reduction (and,
    at ZeRO-0, refuses any backward but its own `engine.backward`). A replay must trigger none
    of that."""
    engine.__dict__["forward"] = engine.module  # nn.Module's setattr would register a submodule
    try:
        yield
    finally:
        del engine.forward


def _replay(engine, micro_batches: Sequence[Any], loss_fn: Callable) -> str:
    named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    for index, micro_batch in enumerate(micro_batches):
        with _plain_forward(engine):
            loss, _ = loss_fn(micro_batch)
        where = f"micro-batch {index + 1} of {len(micro_batches)}"
        if not torch.isfinite(loss).all():
            return f"{where}: the loss itself is {_kind(loss)}"
        # autograd.grad accumulates into no .grad, so DeepSpeed's gradient hooks stay quiet
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        bad = [
            (name, _kind(grad))
            for (name, _), grad in zip(named, grads, strict=True)
            if grad is not None and not torch.isfinite(grad).all()
        ]
        del grads
        if bad:
            kinds = " and ".join(sorted({kind for _, kind in bad}))
            block = _block(bad[-1][0])
            # the block's modules whose parameters have bad gradients, as "mlp.down_proj"
            modules = [name.rpartition(".")[0] for name, _ in bad if _block(name) == block]
            inside = list(dict.fromkeys(m[len(block) + 1 :] for m in modules))
            shown = ", ".join(inside[:12]) + (", ..." if len(inside) > 12 else "")
            # backward runs from the output down: the block nearest the output is where the
            # values arose or entered; every block below it inherits them
            return (
                f"{where}: {kinds} in the gradients of {len(bad)} of {len(named)} parameters, "
                f"nearest the output in {block} ({shown}), the loss finite"
            )
    return ""


def _block(name: str) -> str:
    """The numbered block a parameter belongs to ("model.layers.7" of
    "model.layers.7.mlp.up_proj.weight"), else its module ("lm_head" of "lm_head.weight")."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _kind(tensor: torch.Tensor) -> str:
    return "NaN" if torch.isnan(tensor).any() else "inf"


class SkippedSteps:
    """Counts one role's steps whose update was skipped, and stops the run once `limit` steps
    in a row were skipped.

    `count` reads a training call's `metrics`: "skipped" (how many of its optimizer updates were
    skipped) and "nonfinite" (where the values arose). A step counts as skipped when any of its
    updates was."""

    def __init__(self, limit: int, role: str, key: str = "[trainer] max_skipped_steps"):
        self.limit, self.role, self.key = limit, role, key
        self.in_a_row = 0

    def count(self, step: int, metrics: dict) -> None:
        if not metrics.get("skipped"):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            where = metrics.get("nonfinite") or "not found by replaying the micro-batches"
            raise NonFiniteGradientError(
                f"the {self.role}'s gradients were not finite at {self.in_a_row} steps in a row "
                f"(the last step {step}; {self.key} = {self.limit}), each "
                f"update skipped, no weights changed: {where}. The run stops here; {ADVICE}"
            )


def is_finite(norm) -> bool:
    """Whether a gradient norm (a float or a tensor, DeepSpeed's -1 for "invalid" included)
    is a real one."""
    value = float(norm)
    return math.isfinite(value) and value >= 0
