"""A synthetic preference task: the correct reversal of a word is preferred.

    rows = reversal_pairs(512, seed=1)   # [{"prompt", "chosen", "rejected"}, ...]
    rows = policy_reversal_pairs("examples/tiny/model", 4096, seed=1)   # on a policy's samples
    rows = reversal_sft_rows(19200, seed=7)   # [{"prompt", "response"}, ...]: the task as SFT data

The prompt is the tiny example's ("Reverse the string abc. Answer:"), and the chosen response
is the reversed word (" cba"). Half the time, the rejected response has the same letters in
another order; otherwise it is the reversal of another word. The rows are deterministic for a
seed. policy_reversal_pairs makes pairs from a policy's own samples instead, as in classic
RLHF, where the reward model scores what the policy writes.
"""

import itertools
import random

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reversal_pairs(count: int, seed: int) -> list[dict]:
    rng, rows = random.Random(seed), []
    while len(rows) < count:
        word = "".join(rng.sample(LETTERS, 3))
        if rng.random() < 0.5:  # the right letters in a wrong order
            wrong = [w for w in map("".join, itertools.permutations(word)) if w != word[::-1]]
            rejected = rng.choice(wrong)
        else:  # the reversal of another word
            rejected = "".join(rng.sample(LETTERS, 3))[::-1]
        rows.append(
            {
                "prompt": f"Reverse the string {word}. Answer:",
                "chosen": f" {word[::-1]}",
                "rejected": f" {rejected}",
            }
        )
    return rows


def reversal_sft_rows(count: int, seed: int, *, exclude=(), length: int = 3) -> list[dict]:
    """The task as SFT data (`rlhf-train sft`). The prompts use random words (letters may
    repeat) and never one in `exclude`; the response is the reversed word. Deterministic for a
    seed."""
    rng, excluded, rows = random.Random(seed), set(exclude), []
    while len(rows) < count:
        word = "".join(rng.choice(LETTERS) for _ in range(length))
        prompt = f"Reverse the string {word}. Answer:"
        if prompt not in excluded:
            rows.append({"prompt": prompt, "response": f" {word[::-1]}"})
    return rows


def in_place(response: str, answer: str) -> float:
    """The characters that the response has in the right place, as a fraction of the longer of
    the response and the answer (both stripped). This matches ferrule-rewards'
    `builtin.char_match`, which the testkit does not depend on. Only the answer scores 1.0."""
    response, answer = response.strip(), answer.strip()
    hits = sum(a == b for a, b in zip(response, answer, strict=False))
    return hits / max(len(response), len(answer), 1)


def policy_reversal_pairs(
    model_path,
    count: int,
    seed: int,
    *,
    exclude=(),
    length: int = 3,
    samples: int = 8,
    temperatures: tuple[float, ...] = (0.6, 1.0),
    max_tokens: int = 6,
    per_prompt: int = 4,
    edit_fraction: float = 0.5,
    edit_weights: tuple[float, ...] = (1, 2, 1),
    gold_fraction: float = 0.5,
) -> list[dict]:
    """Preference pairs from a policy's own samples, as classic RLHF collects them. A reward
    model trained on these scores what the policy writes, not only hand-made mistakes.

        rows = policy_reversal_pairs("examples/tiny/model", 4096, seed=1, exclude=held_out)

    Prompts are the tiny example's ("Reverse the string abc. Answer:", letters may repeat),
    never one in `exclude`. For each prompt, the policy at `model_path` writes `samples`
    responses at each temperature (Hugging Face `generate`, `max_tokens` new tokens, as the
    launcher's engines do). Then `per_prompt` pairs are made, each in one of three ways:
    - with probability `edit_fraction`, the correct answer (" cba") is chosen over the answer
      with one letter changed. The position is drawn with `edit_weights`, because a 2-layer
      scorer learns the middle letter last.
    - otherwise, with probability `gold_fraction`, the answer is chosen over a wrong sample.
    - else, of two samples, the one with more letters in place (`in_place`) is chosen over
      the one with fewer.
    Deterministic for a seed (on one torch version and device).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if len(edit_weights) != length:
        raise ValueError(f"edit_weights needs {length} weights, one per letter")
    rng, excluded, rows = random.Random(seed), set(exclude), []
    generator = torch.Generator().manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    while len(rows) < count:
        problems = []
        while len(problems) < 64:
            word = "".join(rng.choice(LETTERS) for _ in range(length))
            prompt = f"Reverse the string {word}. Answer:"
            if prompt not in excluded:
                problems.append((prompt, f" {word[::-1]}"))
        ids = [tokenizer.encode(p) for p, _ in problems]
        width = max(map(len, ids))
        inputs = torch.full((len(ids), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(inputs)
        for row, sequence in enumerate(ids):  # left padding, for generation
            inputs[row, width - len(sequence) :] = torch.tensor(sequence)
            mask[row, width - len(sequence) :] = 1
        texts = [[] for _ in problems]
        for temperature in temperatures:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
            with torch.no_grad():
                out = model.generate(
                    input_ids=inputs,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=max_tokens,
                    num_return_sequences=samples,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            decoded = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            for index in range(len(problems)):
                texts[index] += decoded[index * samples : (index + 1) * samples]
        for (prompt, answer), responses in zip(problems, texts, strict=True):
            scored = [(in_place(t, answer), t) for t in sorted(set(responses))]
            wrong = [item for item in scored if item[0] < 1.0]
            for _ in range(per_prompt):
                if rng.random() < edit_fraction:
                    k = rng.choices(range(length), edit_weights)[0]
                    letter = rng.choice(LETTERS.replace(answer[1 + k], ""))
                    chosen, rejected = answer, answer[: 1 + k] + letter + answer[2 + k :]
                elif rng.random() < gold_fraction:
                    if not wrong:
                        continue
                    chosen, rejected = answer, rng.choice(wrong)[1]
                else:
                    if len(scored) < 2:
                        continue
                    first, second = rng.sample(scored, 2)
                    if first[0] == second[0]:
                        continue
                    chosen, rejected = max(first, second)[1], min(first, second)[1]
                rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    rng.shuffle(rows)
    return rows[:count]
