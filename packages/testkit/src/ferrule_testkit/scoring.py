"""The trainer's view of rollout samples, for tests and benchmarks that compare the two.

    trainer_logprobs = teacher_forced_logprobs(model, samples, micro_batch=16, temperature=1.0)

A plain transformers model scores each sample's tokens the way ferrule-trainer lays out and
scores a batch (batch.py, sequences.py). Prompts are left-padded and responses right-padded, so
every response starts at the same column. Positions count only real tokens. Samples are scored
together in micro-batches, and the logprobs are log_softmax(logits / temperature) in float32. A
test of the rollout engine can then compare its logprobs with the trainer's without importing
the trainer.
"""


def teacher_forced_logprobs(model, samples, micro_batch: int = 16, temperature: float = 1.0):
    """One float32 CPU tensor per sample: the logprobs of its response tokens under `model`."""
    import torch

    device = next(model.parameters()).device
    out = []
    for start in range(0, len(samples), micro_batch):
        part = samples[start : start + micro_batch]
        width = max(len(s.prompt_token_ids) for s in part)
        length = max(len(s.token_ids) for s in part)
        ids = torch.zeros(len(part), width + length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(part):
            prompt, tokens = s.prompt_token_ids, s.token_ids
            ids[r, width - len(prompt) : width] = torch.tensor(prompt)
            ids[r, width : width + len(tokens)] = torch.tensor(tokens)
            mask[r, width - len(prompt) : width + len(tokens)] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                logits_to_keep=length + 1,
            ).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
        chosen = logprobs.gather(-1, ids[:, width:, None])[..., 0].cpu()
        out += [chosen[r, : len(s.token_ids)] for r, s in enumerate(part)]
    return out
