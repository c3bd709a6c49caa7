"""One rank of test_sequence_parallel.py.

argv: model_path, out_dir, sequence_parallel, zero_stage, "plain" or "composed" (the Actor with
gradient checkpointing and LoRA, its passes packed and cut by tokens; step 2 only). Every rank
holds the same batch (T = 21 columns: not a multiple of 2 or 4, so the sharding pads).

1. The plain model (no DeepSpeed): sequence-parallel response log-probabilities and entropies of
   the padded batch, its packed form and the batch without padding (`layouts`), and the
   gradients of a fixed function of them, summed over the group's ranks. Rank 0 writes them
   (first.pt).
2. An Actor with `sequence_parallel` ranks takes the log-probabilities of the batch and one PPO
   step of two micro-batches (KL to a reference and an entropy bonus on). Rank 0 writes the
   metrics and the weights after the step (actor.pt).
3. A Critic likewise: its values of the batch and one value-loss step (critic.pt).
With sequence_parallel = 1 and one process this is the reference run.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rank_exit import leave_and_exit

from ferrule_trainer.actor import Actor
from ferrule_trainer.batch import Batch
from ferrule_trainer.critic import Critic
from ferrule_trainer.settings import ForwardPlan, PolicyLoss, ValueLoss


def batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    rows, length, response = 4, 21, 8
    ids = torch.randint(0, 500, (rows, length), generator=generator)
    attention = torch.ones(rows, length, dtype=torch.long)
    attention[0, :5] = 0  # left padding of a short prompt
    attention[3, -3:] = 0  # right padding of a short response
    made = Batch(ids, attention, attention[:, -response:].clone())
    return made.replace(
        old_logprobs=-2.0 + 0.1 * torch.randn(rows, response, generator=generator),
        ref_logprobs=-2.0 + 0.1 * torch.randn(rows, response, generator=generator),
        advantages=torch.randn(rows, response, generator=generator),
    )


def weights(rows: int, response: int) -> torch.Tensor:
    """Fixed, uneven weights: a loss of them tells every position's gradient apart."""
    return torch.linspace(-1.0, 2.0, rows * response).view(rows, response)


def plain_model_pass(model_path: str, size: int) -> dict:
    from transformers import AutoModelForCausalLM

    from ferrule_trainer import sequence_parallel as sp
    from ferrule_trainer import sequences

    # the LM head on at most 3 of a rank's positions at a time, as on 1,024 of a long sequence's
    # (a shard's whole logits were 37 GiB at 64k positions of a 152k vocabulary)
    widest, head_call = [], sequences._head_logprobs
    sequences.HEAD_CHUNK = 3
    sequences._head_logprobs = lambda head, rows, *rest: (
        widest.append(len(rows)) or head_call(head, rows, *rest)
    )
    group = sp.SequenceGroup.split(size)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    sp.install(model, group)
    out = {}
    for layout, (data, packed) in layouts().items():
        model.zero_grad()
        logprobs, entropy = sp.response_logprobs(
            model, data, 0.7, group, packed=packed, entropy=True
        )
        w = weights(*logprobs.shape)
        ((logprobs * w).sum() + (entropy * w.flip(0)).sum()).backward()
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=group.group)  # the group's ranks' shares, summed
            grads[name] = grad
        out[layout] = dict(logprobs=logprobs.detach(), entropy=entropy.detach(), grads=grads)
    sequences._head_logprobs = head_call
    out["widest_head_call"] = max(widest)
    return out


def layouts() -> dict[str, tuple[Batch, bool]]:
    """The batch padded, packed, and without padding (the causal mask alone: the columns the
    sharding adds on the right must be seen by no real position)."""
    data = batch()
    full = data.replace(
        attention_mask=torch.ones_like(data.attention_mask),
        response_mask=torch.ones_like(data.response_mask),
    )
    return {"padded": (data, False), "packed": (data, True), "unpadded": (full, False)}


def actor_step(model_path: str, size: int, zero_stage: int, composed: bool) -> dict:
    """`composed`: with gradient checkpointing and LoRA, the passes packed and cut by tokens."""
    actor = Actor(
        model_path,
        zero_stage=zero_stage,
        dtype="float32",
        learning_rate=1e-2,
        temperature=0.7,
        sequence_parallel=size,
        gradient_checkpointing=composed,
        lora_rank=4 if composed else 0,
    )
    data = batch()
    plan = ForwardPlan(micro_batch_size=4, micro_batch_tokens=48, packed=True) if composed else None
    logprobs = actor.logprobs(data, plan) if composed else actor.logprobs(data)
    loss = PolicyLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    metrics = actor.train_step(data.split(2), loss, packed=composed)
    return dict(
        logprobs=logprobs,
        metrics=metrics,
        weights={name: t.clone() for name, t in actor.export_weights()},  # gathered (ZeRO-3)
    )


def critic_step(model_path: str, size: int, zero_stage: int) -> dict:
    critic = Critic(
        model_path,
        zero_stage=zero_stage,
        dtype="float32",
        learning_rate=1e-2,
        sequence_parallel=size,
    )
    data = batch()
    values = critic.values(data)
    generator = torch.Generator().manual_seed(1)
    data = data.replace(
        old_values=values + 0.1 * torch.randn(values.shape, generator=generator),
        returns=torch.randn(values.shape, generator=generator),
    )
    metrics = critic.train_step(data.split(2), ValueLoss(clip=0.2))
    weights = None
    if zero_stage < 3:  # partitioned under ZeRO-3: its loss and gradient norm are compared
        weights = {n: p.detach().clone() for n, p in critic.engine.module.named_parameters()}
    return dict(values=values, metrics=metrics, weights=weights)


if __name__ == "__main__":
    model_path, out_dir = sys.argv[1], Path(sys.argv[2])
    size, zero_stage, composed = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "composed"
    actor = actor_step(model_path, size, zero_stage, composed)  # initialises torch.distributed
    critic = None if composed else critic_step(model_path, size, zero_stage)
    first = plain_model_pass(model_path, size) if size > 1 and not composed else None
    if int(os.environ["RANK"]) == 0:
        torch.save(actor, out_dir / "actor.pt")
        if critic is not None:
            torch.save(critic, out_dir / "critic.pt")
        if first is not None:
            torch.save(first, out_dir / "first.pt")
    leave_and_exit()
