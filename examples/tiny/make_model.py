"""Rebuild examples/tiny/model, the tiny example's warm-started policy: `uv run python examples/tiny/make_model.py`.

1. ferrule-testkit's tiny Qwen2 (2 layers, hidden 128, vocabulary 512, random weights, seed 0)
   with its byte-level BPE tokenizer;
2. a deliberately short SFT warm start on the example's task (3-letter reversal), stopped as
   soon as greedy accuracy on the held-out prompts reaches TARGET, so that RL has room to
   improve it (the launcher's tiny run then measures accuracy before and after RL).
The result (about 1.5 MB) is shipped in the repository because ferrule-testkit is a development
tool, not a dependency of the launcher. Deterministic for the installed torch version.
"""

import random
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from ferrule_launcher.task import eval_problems, step_problems
from ferrule_rewards.builtin import exact_text
from ferrule_testkit import tiny_model

TARGET = 0.3  # greedy held-out accuracy at which the warm start stops
TASK, LENGTH, EVAL_PROMPTS, SEED = "reversal", 3, 100, 0  # as in examples/tiny.toml
OUT = Path(__file__).parent / "model"


def greedy_accuracy(model, tokenizer, problems) -> float:
    ids = [tokenizer.encode(p) for p, _ in problems]
    width = max(map(len, ids))
    x = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(x)
    for row, seq in enumerate(ids):
        x[row, width - len(seq) :], mask[row, width - len(seq) :] = torch.tensor(seq), 1
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=6,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    model.train()
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(exact_text(t, a) for t, (_, a) in zip(texts, problems, strict=True)) / len(texts)


def main() -> None:
    torch.manual_seed(SEED)
    random.seed(SEED)
    torch.set_num_threads(2)
    base = tiny_model("qwen2", seed=SEED)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    held_out = eval_problems(TASK, LENGTH, EVAL_PROMPTS, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    for step in range(1, 301):
        # Negative steps: prompts the RL stage never sees (it uses steps 1, 2, ...).
        batch = step_problems(TASK, LENGTH, 32, SEED, -1000 - step, held_out)
        pairs = [(tokenizer.encode(p), [*tokenizer.encode(a), eos]) for p, a in batch]
        width = max(len(p) + len(a) for p, a in pairs)
        x = torch.full((len(pairs), width), tokenizer.pad_token_id)
        attention, loss_mask = torch.zeros_like(x), torch.zeros_like(x)
        for row, (p, a) in enumerate(pairs):
            x[row, : len(p) + len(a)] = torch.tensor(p + a)
            attention[row, : len(p) + len(a)] = 1
            loss_mask[row, len(p) : len(p) + len(a)] = 1
        logits = model(input_ids=x, attention_mask=attention).logits[:, :-1]
        per_token = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        loss = (per_token.view(len(pairs), -1) * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= 40 and step % 2 == 0:
            accuracy = greedy_accuracy(model, tokenizer, held_out)
            print(
                f"sft step {step}: loss {loss.item():.3f} held-out greedy accuracy {accuracy:.2f}"
            )
            if accuracy >= TARGET:
                break
    else:
        sys.exit(f"accuracy never reached {TARGET}")
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_pretrained(OUT)
    tokenizer.save_pretrained(OUT)
    print(f"wrote {OUT} (warm start of {step} SFT steps, held-out greedy accuracy {accuracy:.2f})")


if __name__ == "__main__":
    main()
