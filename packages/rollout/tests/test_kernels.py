"""kernels.py's Triton kernels, run by Triton's interpreter on the CPU (a process of its own:
TRITON_INTERPRET must be set before Triton is imported): decode attention against sdpa with the
same mask on inputs that break a naive kernel (pages in shuffled order, NaN wherever a row must
not read) and inside the decode loop on the kit models, with a pool small enough that rows wait
for pages; the draw against sampling.sample's inverse CDF in float64."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

AGAINST_SDPA = """
import torch
import torch.nn.functional as F
from ferrule_rollout import kernels
from ferrule_rollout.kernels import PAGE, decode_attention

# keys, values [rows, kv, length, dim] as pools of pages in shuffled order, and each row's
# table up to its slot's page; page 0 and every slot past a row's own are NaN: never read
def paged(keys, values, slots):
    rows, kv, length, dim = keys.shape
    width = -(-length // PAGE)
    pools = [torch.full((1 + rows * width, kv, PAGE, dim), float("nan"), dtype=keys.dtype)
             for _ in "kv"]
    table = torch.zeros(rows, width, dtype=torch.long)
    order = torch.randperm(rows * width) + 1
    for r, slot in enumerate(slots.tolist()):
        for k in range(slot // PAGE + 1):
            table[r, k] = page = int(order[r * width + k])
            for pool, dense in zip(pools, (keys, values)):
                end = min((k + 1) * PAGE, slot + 1)
                pool[page, :, : end - k * PAGE] = dense[r, :, k * PAGE : end]
    return *pools, table

def check(rows, kv, group, dim, length, slots, pads, dtype, tolerance):
    for multiprocessors in (0, 10**6):  # each row in one program; each split over several
        kernels._multiprocessors = lambda device: multiprocessors
        check_once(rows, kv, group, dim, length, slots, pads, dtype, tolerance)

def check_once(rows, kv, group, dim, length, slots, pads, dtype, tolerance):
    torch.manual_seed(rows * 1000 + length)
    heads = kv * group
    query = torch.randn(rows, 1, heads, dim, dtype=dtype).transpose(1, 2)  # HF's strided layout
    keys = 4 * torch.randn(rows, kv, length, dim, dtype=dtype)  # large scores: softmax's max
    values = torch.randn(rows, kv, length, dim, dtype=dtype)
    slots = torch.tensor(slots)
    where = torch.arange(length)
    pad_ok = where[None, :] >= torch.tensor(pads)[:, None]  # left padding
    visible = (pad_ok & (where <= slots[:, None])) | (where == slots[:, None])
    key_pool, value_pool, table = paged(keys, values, slots)
    got = decode_attention(query, key_pool, value_pool, visible, slots, table, dim**-0.5)
    grouped = query.reshape(rows, kv, group, dim).float()
    want = F.scaled_dot_product_attention(
        grouped, keys.float(), values.float(), attn_mask=visible[:, None, None, :]
    )
    want = want.reshape(rows, heads, 1, dim).transpose(1, 2)
    assert got.shape == want.shape and got.dtype == dtype
    error = (got.float() - want).abs().max().item()
    assert error < tolerance, (rows, kv, group, dim, length, error)

# a first block wholly padding (row 1), slot 0 (row 0: only itself), a row at the last slot
check(3, 2, 6, 64, 160, [0, 100, 159], [0, 70, 3], torch.float32, 1e-5)
check(2, 1, 1, 128, 64, [63, 10], [0, 0], torch.float32, 1e-5)      # one head a KV head
check(2, 4, 8, 32, 200, [130, 199], [129, 0], torch.float32, 1e-5)  # padding up to the slot
# rows over several of the kernel's splits (kernels.SPLIT = 256 slots): split edges, a split
# wholly padding (row 1), rows of one split beside rows of three
check(5, 2, 6, 64, 700, [255, 256, 699, 40, 511], [0, 300, 3, 0, 511], torch.float32, 1e-5)
check(2, 4, 8, 32, 520, [519, 300], [0, 299], torch.float16, 2e-3)
# half precision in, float32 softmax inside (the interpreter has no bfloat16: test_hf_engine_gpu)
check(4, 2, 6, 64, 128, [5, 64, 65, 127], [0, 1, 2, 3], torch.float16, 2e-3)
print("ok")
"""

DRAW = """
import torch
from ferrule_rollout.kernels import draw
from ferrule_rollout.sampling import sample

def check(logits, u, temperature):
    chosen, logprob = draw(logits, temperature, u)
    eager, _ = sample(logits, temperature, 0, 1.0, u)
    logprobs = torch.log_softmax(logits.double() / temperature, -1)
    cdf = logprobs.exp().cumsum(-1)
    point = u * (1 - 2**-20) * cdf[:, -1]
    for r in range(len(u)):
        c = int(chosen[r])
        below = float(cdf[r, c - 1]) if c else 0.0
        # a correct inverse-CDF draw, up to float32 sums
        assert below - 1e-5 <= point[r] < cdf[r, c] + 1e-5, (r, c, below, point[r], cdf[r, c])
        assert logprobs[r, c] > -1e9, (r, c)  # never a token of probability 0
        assert abs(logprob[r] - logprobs[r, c]) < 1e-4, (r, float(logprob[r]), logprobs[r, c])
    assert (chosen == eager).float().mean() >= 0.8, (chosen, eager)

torch.manual_seed(0)
u = torch.tensor([0.0, 1e-9, 0.25, 0.5, 0.999, 1 - 1e-12], dtype=torch.float64)
rows = len(u)
check(3 * torch.randn(rows, 5000), u, 1.0)  # not a multiple of the kernel's block
steps = torch.rand(rows, 7, dtype=torch.float64)
check(3 * torch.randn(rows, 5000), steps[:, 3], 1.0)  # a column of the loop's draws: strided
check(torch.randn(rows, 5000).half(), u, 0.7)
masked = torch.randn(rows, 6000)
masked[:, ::2] = float("-inf")  # half the vocabulary cut (as top-k would)
masked[:, -3000:] = float("-inf")  # and every block past the middle
check(masked, u, 1.0)
check(torch.zeros(rows, 4099), u, 1.0)  # all equal: u picks the token
dominant = torch.zeros(rows, 3000)
dominant[:, 1234] = 60.0  # one token takes ~all the mass: extreme log-ratios elsewhere
check(dominant, u, 1.0)
chosen, logprob = draw(dominant, 1.0, u)
assert chosen[2:5].tolist() == [1234] * 3 and abs(float(logprob[3])) < 1e-6
check(torch.randn(rows, 100), u, 1.3)  # smaller than one block
print("ok")
"""

IN_THE_LOOP = """
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from ferrule_rollout import decode, kernels
from ferrule_rollout.hf_engine import ATTENTION, slab_attention
from ferrule_testkit import tiny_model

AttentionInterface.register(ATTENTION, slab_attention)
calls = []
def counted(*args):
    calls.append(args[0].shape[0])
    return kernels.decode_attention(*args)

decode.decode_attention = counted

prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 170)), [7]]
for arch in ("qwen2", "llama"):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model(arch), dtype=torch.float32, attn_implementation=ATTENTION
    ).eval()
    runs = []
    # sdpa over gathered pages; the kernel; the kernel with a pool of 6 pages (3 rows need up
    # to 3 each), where the rows started last wait for pages
    for kernel, kv_tokens in ((False, None), (True, None), (True, 5 * kernels.PAGE)):
        decoder = decode.Decoder(model, float_mask=False, kv_tokens=kv_tokens)
        decoder.kernels = decoder.cache.paged_reads = kernel  # the draw too, as on CUDA
        runs.append(decoder.generate(
            prompts, [12, 30, 9, 20], pad=1, keys=[0, 1, 2, 3], temperature=1.0, top_k=0,
            top_p=1.0, eos=None, max_rows=3,
        ))
    assert calls, "the kernel was never called"
    for (t0, l0, n0, _), (t1, l1, n1, _), (t2, l2, n2, _) in zip(*runs):
        assert (t1, n1) == (t2, n2) and max(abs(a - b) for a, b in zip(l1, l2)) < 1e-5, arch
        assert t0 == t1 and n0 == n1, (arch, t0, t1)
        assert max(abs(a - b) for a, b in zip(l0, l1)) < 1e-4, arch
    calls.clear()
print("ok")
"""


def interpreted(script: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_kernel_equals_sdpa_and_reads_no_slot_past_a_rows_own():
    interpreted(AGAINST_SDPA)


def test_the_draw_is_an_inverse_cdf_draw_of_the_tempered_softmax():
    interpreted(DRAW)


@pytest.mark.e2e  # ~20 s on 2 cores: the whole decode loop, twice
def test_the_decode_loop_gives_the_same_samples_with_the_kernel():
    interpreted(IN_THE_LOOP)
