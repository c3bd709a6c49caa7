"""Helpers for the rollout tests: a transformers reference, weight perturbation, free ports,
`rlhf-rollout serve` with the transformers engine.

Imported by path (`sys.path` gets this folder) because pytest runs in importlib mode.
"""

import os
import socket
import subprocess
import sys
import threading

from ferrule_testkit import tiny_model

# Log-probabilities from vLLM (float32, CPU) and from a transformers forward pass of the same
# weights differ only by kernel rounding: measured max |diff| 1e-6 over 32 x 100 sampled tokens
# on both kit models. 1e-3 leaves room for other kernels (tensor parallelism) while a weight
# that failed to load shows up as 0.07 or more.
LOGPROB_ATOL = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_logprobs(
    model, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0, top_k: int = 0
):
    """Teacher-forced transformers forward pass over prompt + sampled tokens: the log-probability
    of each sampled token under softmax(logits / temperature) over the top-k tokens (all when
    top_k is 0), and the greedy (argmax) choice at each position."""
    import torch

    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    return chosen, logits.argmax(dim=-1)


def perturb_(model, seed: int, scale: float = 0.5) -> None:
    """Change every weight enough to change greedy outputs: w += scale * std(w) * noise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=g)
            param.add_(noise * scale * (param.float().std() if param.numel() > 1 else 1.0))


def perturbed_and_loaded(engine, sender, policy, seed: int) -> int:
    """`policy` perturbed with `seed`, sent by `sender` (closed after) and loaded by `engine`;
    returns the version loaded."""
    try:
        perturb_(policy, seed=seed)
        sending = in_thread(sender.send, list(policy.named_parameters()))
        version = engine.update_weights(timeout=60)
        sending.get()
        return version
    finally:
        sender.close(timeout=0)  # the engine receives only when told to: no end to wait for


def in_thread(fn, *args, **kwargs) -> "Result":
    """Run fn in a thread (a weight-sync sender, while the engine receives here)."""
    result = Result()

    def run():
        try:
            result.value = fn(*args, **kwargs)
        except BaseException as err:  # handed to the test by Result.get
            result.error = err

    result.thread = threading.Thread(target=run, daemon=True)
    result.thread.start()
    return result


class Result:
    value = None
    error = None
    thread: threading.Thread

    def get(self, timeout: float = 120.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def assert_matches_transformers(samples, model, greedy: bool, **sampling) -> None:
    """Each sample's logprobs are `model`'s teacher-forced ones for its tokens (within
    LOGPROB_ATOL); greedy: its tokens are the argmax ones."""
    import torch

    for sample in samples:
        expected, argmax = hf_logprobs(model, sample.prompt_token_ids, sample.token_ids, **sampling)
        got = torch.tensor(sample.logprobs)
        assert torch.allclose(got, expected, atol=LOGPROB_ATOL), (got - expected).abs().max()
        if greedy:
            assert sample.token_ids == argmax.tolist()


def start_transformers_server(
    *options: str, env: dict | None = None
) -> tuple[subprocess.Popen, str]:
    """`rlhf-rollout serve` on the tiny model with `options`; (process, address) once ready."""
    command = [sys.executable, "-m", "ferrule_rollout", "serve", "--engine", "transformers"]
    command += ["--model", str(tiny_model("qwen2")), "--dtype", "float32", "--max-model-len", "128"]
    process = subprocess.Popen(
        [*command, *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("rlhf-rollout: serving"):
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, line.rsplit(" on ", 1)[1].strip()
    process.wait(30)
    raise AssertionError(f"exit {process.returncode} before serving:\n" + "".join(lines[-20:]))
