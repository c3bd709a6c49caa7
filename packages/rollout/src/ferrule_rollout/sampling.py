"""Sampling on the device: vLLM's processed logprobs, counter-based uniforms and inverse-CDF draws.

    u = uniforms(keys, steps)                   # [rows, steps]: a row's draws depend on its key
    tokens, logprobs = sample(logits, temperature, top_k, top_p, u[:, t])

decode.py calls these once per decode step. Nothing here copies results back to the host.
"""

import torch

MASK32 = 0xFFFFFFFF


def sampling_logprobs(logits, temperature: float, top_k: int, top_p: float):
    """Return the log-probabilities of the distribution that a token is drawn from (vLLM's
    processed logprobs). This is log_softmax(logits / temperature), kept to the top-k tokens and
    then to the top-p tokens. Greedy sampling (temperature 0) uses log_softmax(logits). The
    result is float32 whatever the model's dtype."""
    logits = logits.float()
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:  # as vLLM does, drop the least likely tokens whose total mass is <= 1 - top_p
        ascending, order = scaled.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        scaled = scaled.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scaled, dim=-1)


def _mix(x):
    """A 32-bit integer hash of int64 values in [0, 2**32). The constants are < 2**31, so the
    products do not overflow."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def uniforms(keys, steps: int, first=None, device=None):
    """Return [rows, steps] float64 uniforms in [0, 1). Row r's draw at step t depends only on
    keys[r] and t. This is a counter-based generator: it carries no state, and a row gets the
    same draws in any batch and any chunk.

    `first` (one value per row) makes row r's draws those of steps first[r] .. first[r] +
    steps - 1. A sample continued after first[r] tokens then draws what one uninterrupted call
    would have drawn. The arithmetic is integer-only, so every `device` gives the same bits. On
    the GPU, a call at a 16k cap therefore does not wait for the CPU (512 rows x 16,384 steps
    take ~1 s on the CPU)."""
    keys = torch.as_tensor(keys, dtype=torch.long, device=device)
    row = _mix(_mix((keys & MASK32) ^ 0x6A09E667) ^ ((keys >> 32) & MASK32))
    at = torch.arange(steps, dtype=torch.long, device=device)[None, :]
    if first is not None:
        at = at + torch.as_tensor(first, dtype=torch.long, device=device)[:, None]
    step = _mix(at + 0x3C6EF372)
    high = _mix(row[:, None] ^ step)
    low = _mix(high ^ 0x5BD1E995)
    return ((high << 21) + (low >> 11)).double() / 2.0**53


def sample(logits, temperature: float, top_k: int, top_p: float, u, logprobs_of=None, kernel=False):
    """Draw one token per row and return it with its logprob under `sampling_logprobs` (or
    under `logprobs_of`, a compiled copy of that function). The work stays on the logits'
    device. Temperature 0 is greedy; otherwise the token is drawn by inverse CDF at the row's
    uniform `u` (float64 [rows]). With `kernel` (CUDA), kernels.draw makes the draw when neither
    top-k nor top-p removes tokens. It is the same draw in fewer passes, with different
    rounding."""
    if kernel and temperature > 0 and top_p >= 1 and not 0 < top_k < logits.shape[-1]:
        from ferrule_rollout.kernels import draw

        return draw(logits, temperature, u)
    logprobs = (logprobs_of or sampling_logprobs)(logits, temperature, top_k, top_p)
    if temperature == 0:
        chosen = logits.argmax(dim=-1)
    else:
        cdf = logprobs.exp().cumsum(dim=-1)
        # Scale u below 1 - 2**-20 so that the point stays below the CDF's total. Then a token
        # of probability 0 after the last likely token is never chosen.
        point = (u * (1 - 2.0**-20)).float()[:, None] * cdf[:, -1:]
        chosen = torch.searchsorted(cdf, point, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    return chosen, logprobs.gather(1, chosen[:, None])[:, 0]
