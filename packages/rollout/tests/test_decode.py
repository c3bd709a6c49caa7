"""decode.py on the kit model (float32, CPU): the loop against a teacher-forced forward to 1e-5,
host reads every k steps against every step, the slab reused across shapes, the sampler's
uniforms and its inverse CDF."""

import pytest
import torch

from ferrule_rollout.decode import Decoder
from ferrule_rollout.kernels import PAGE
from ferrule_rollout.sampling import sample, uniforms
from ferrule_testkit import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 130)), [7]]


@pytest.fixture(scope="module")
def model():
    from transformers import AttentionInterface, AutoModelForCausalLM

    from ferrule_rollout.hf_engine import ATTENTION, slab_attention

    AttentionInterface.register(ATTENTION, slab_attention)
    path = tiny_model("qwen2")
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=ATTENTION
    ).eval()


@pytest.fixture(scope="module")
def eager():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model("qwen2"), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def run(decoder, prompts=PROMPTS, limits=None, **options):
    settings = dict(pad=1, keys=list(range(len(prompts))), temperature=1.0, top_k=0, top_p=1.0)
    settings.update({"eos": None, **options})
    return decoder.generate(prompts, limits or [20] * len(prompts), **settings)


def teacher_forced(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    if temperature:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0], logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_and_logprobs_equal_a_teacher_forced_forward(model, temperature):
    results = run(Decoder(model, float_mask=False), temperature=temperature)
    for prompt, (tokens, logprobs, length, finish) in zip(PROMPTS, results, strict=True):
        assert length == len(tokens) == 20 and finish == "length"
        expected, logits = teacher_forced(model, prompt, tokens, temperature)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
        if temperature == 0:
            assert tokens == logits.argmax(-1).tolist()


def test_eager_float_masks_give_the_same_tokens(model, eager):
    ours = run(Decoder(model, float_mask=False), temperature=0.0)
    theirs = run(Decoder(eager, float_mask=True), temperature=0.0)
    assert [r[0] for r in ours] == [r[0] for r in theirs]


def test_reads_every_k_steps_stop_where_reads_every_step_do(model):
    decoder = Decoder(model, float_mask=False)
    limits = [30, 12, 30, 5]
    free = [r[0] for r in run(decoder, limits=limits)]
    eos = [free[0][9], free[2][17]]  # rows 0 and 2 end there (or earlier, on the other one)

    def stop_hit(tokens):
        return tokens[-2:] == free[3][1:3]  # row 3 completes it at its third token

    def expected(tokens, limit):  # one token at a time, on the host
        for i, token in enumerate(tokens[:limit]):
            if token in eos or stop_hit(tokens[: i + 1]):
                return i + 1, "stop"
        return limit, "length"

    for every in (1, 3, 16, 64):
        got = run(decoder, limits=limits, eos=eos, stop_hit=stop_hit, read_every=every)
        for (tokens, logprobs, length, finish), row, limit in zip(got, free, limits, strict=True):
            assert (length, finish) == expected(row, limit)
            assert tokens == row[:length] and len(logprobs) == length
    assert got[3][2:] == (3, "stop") and got[0][3] == "stop"


def test_the_slab_is_reused_across_shapes(model):
    decoder = Decoder(model, float_mask=False)
    small = run(decoder, PROMPTS[:2], limits=[8, 8])
    large = run(decoder, PROMPTS * 3, limits=[40] * 12)
    assert decoder.cache.keys and len(decoder.cache.keys) == model.config.num_hidden_layers
    assert run(decoder, PROMPTS[:2], limits=[8, 8]) == small
    assert run(Decoder(model, float_mask=False), PROMPTS * 3, limits=[40] * 12) == large


def test_uniforms_depend_on_the_key_and_step_only():
    table = uniforms([3, 7, 3, 2**40 + 3], 50)
    assert table.dtype == torch.float64 and table.shape == (4, 50)
    assert torch.equal(table[0], table[2]) and not torch.equal(table[0], table[3])
    assert torch.equal(uniforms([7], 20)[0], table[1, :20])
    many = uniforms(list(range(2000)), 100).flatten()
    assert ((many >= 0) & (many < 1)).all()
    assert abs(many.mean() - 0.5) < 0.01 and abs(many.std() - 12**-0.5) < 0.01
    counts = torch.histc(many.float(), bins=10, min=0, max=1)
    assert (counts / len(many) - 0.1).abs().max() < 0.01


def test_inverse_cdf_draws_only_kept_tokens_in_proportion():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0, 3.0]]).repeat(4000, 1)
    u = uniforms(list(range(4000)), 1)[:, 0]
    chosen, logprob = sample(logits, 1.0, 2, 1.0, u)  # top-k 2: tokens 4 and 1 only
    assert set(chosen.tolist()) == {1, 4}
    share = (chosen == 4).double().mean()
    assert abs(share - torch.tensor([3.0, 2.0]).softmax(0)[0]) < 0.03
    assert torch.allclose(logprob[chosen == 4], torch.tensor([1.0, 0.0]).log_softmax(0)[0])
    edges = sample(logits[:2], 1.0, 2, 1.0, torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64))
    assert edges[0].tolist() == [1, 4]  # the first kept token, the last kept token


def test_sliding_window_models_are_refused_with_what_to_use():
    from ferrule_rollout import RolloutError
    from ferrule_rollout.hf_engine import TransformersEngine

    path = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(RolloutError, match=r'sliding-window attention layers.*use backend "vllm"'):
        TransformersEngine(path, dtype="float32")


def test_the_samples_of_a_prompt_share_its_prefill(model, monkeypatch):
    decoder = Decoder(model, float_mask=False)
    widths = []
    forward = decoder.forward
    monkeypatch.setattr(
        decoder,
        "forward",
        lambda ids, *rest, **kw: widths.append(ids.shape) or forward(ids, *rest, **kw),
    )
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[2]] * 2 + [PROMPTS[0]]
    for temperature in (0.0, 1.0):
        results = run(decoder, prompts, limits=[15] * 6, temperature=temperature)
        assert widths[-1] == (2, 30)  # one prefill row per distinct prompt
        for prompt, (tokens, logprobs, *_) in zip(prompts, results, strict=True):
            expected, _ = teacher_forced(model, prompt, tokens, temperature)
            assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
        if temperature == 0:
            assert len({tuple(r[0]) for r in results[:3]} | {tuple(results[5][0])}) == 1
        else:  # keys 0-5: the samples of one prompt differ
            assert len({tuple(r[0]) for r in results[:3]}) == 3


def test_sleep_frees_the_slab_without_the_garbage_collector(monkeypatch):
    """The decoder and its steps refer to each other: sleep must free the slab by hand, or it
    would stay allocated (on a GPU: next to the trainer) until the collector runs."""
    import gc
    import sys

    from ferrule_rollout import SamplingSettings
    from ferrule_rollout.hf_engine import TransformersEngine

    with TransformersEngine(tiny_model("qwen2"), dtype="float32") as engine:
        engine.generate(["a b c"], SamplingSettings(max_tokens=4))
        slab = engine._decoder.cache.keys[0]
        monkeypatch.setattr(engine, "_can_sleep", True)
        gc.disable()  # only reference counts free things from here
        try:
            engine.sleep(1)
            assert engine._decoder is None
            assert sys.getrefcount(slab) == 2  # `slab` and getrefcount's argument
            engine.wake_up()
            assert len(engine.generate(["a b c"], SamplingSettings(max_tokens=4))) == 1
        finally:
            gc.enable()


def test_continuous_batching_gives_each_prompt_what_one_batch_gives_it(model):
    """Two rows at a time, rows leaving at EOS, stop strings and length at different steps and
    queued prompts taking them: every prompt's sample is the one the full batch gives it."""
    decoder = Decoder(model, float_mask=False)
    prompts = [PROMPTS[k % 4] + [k] for k in range(9)]
    limits = [25, 6, 40, 3, 17, 30, 1, 12, 22]
    free = [r[0] for r in run(decoder, prompts, limits=limits)]
    eos = [free[0][4], free[2][30], free[5][8]]
    options = dict(limits=limits, eos=eos, stop_hit=lambda tokens: tokens[-2:] == free[8][5:7])
    full = run(decoder, prompts, **options)
    assert len({n for _, _, n, _ in full}) > 4 and any(s == "stop" for *_, s in full)
    for every in (1, 4, 16):
        for rows in (1, 2, 5):
            queued = run(decoder, prompts, max_rows=rows, read_every=every, **options)
            for (tokens, logprobs, n, finish), expected in zip(queued, full, strict=True):
                assert (tokens, n, finish) == (expected[0], expected[2], expected[3])
                assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected[1]), atol=1e-5)


def test_an_empty_call_returns_nothing():
    from ferrule_rollout import SamplingSettings
    from ferrule_rollout.hf_engine import TransformersEngine

    with TransformersEngine(tiny_model("qwen2"), dtype="float32") as engine:
        assert engine.generate([], SamplingSettings(max_tokens=3)) == []


def test_rows_that_hold_nothing_stay_at_slot_0_while_others_decode(model):
    """A finished row (and a row no prompt took) must not walk on through the slab: on CUDA decode
    attention reads each row up to its slot, so an idle row there would read every slot of the
    slab at every step (at 4096-token caps, most of a long-tailed batch's time)."""
    decoder = Decoder(model, float_mask=False)
    seen = []  # each decode step's slots, as the step saw them

    def forward(ids, positions, pad_ok, slots, **kw):
        seen.append(slots.tolist())
        return decoder.forward(ids, positions, pad_ok, slots, **kw)

    decoder.step_forward = forward
    results = run(decoder, PROMPTS[:3], limits=[2, 30, 3], read_every=1)
    assert [n for _, _, n, _ in results] == [2, 30, 3]
    # row 0 ends after 2 tokens, row 2 after 3; row 1 runs on: from its 4th step, only row 1 moves
    late = seen[5:]
    assert len(late) > 20
    assert all(s[0] == 0 and s[2] == 0 for s in late), late[:3]
    assert [s[1] for s in late] == sorted({s[1] for s in late})  # row 1 moves one slot a step
    # and the samples are those of reads every 16 steps (rows idled later)
    assert results == run(Decoder(model, float_mask=False), PROMPTS[:3], limits=[2, 30, 3])


@pytest.mark.parametrize("compact, widths", [(4, [48, 12]), (2, [48, 24, 12])])
def test_the_tails_rows_move_into_fewer_and_every_sample_stays_the_same(model, compact, widths):
    """48 prompts whose samples end at long-tailed lengths (limits, EOS and a stop string): once
    12 or fewer still run they move into the first 12 rows (compact=4) and decode there, or
    (compact=2) into 24 once 24 suffice and then into 12; each prompt's tokens, logprobs, length
    and stop are what the same call gives without moving."""
    import random

    draw = random.Random(7)
    prompts = [PROMPTS[k % 4] + [k + 1] for k in range(48)]
    limits = [min(60, 2 + int(draw.expovariate(1 / 12))) for _ in prompts]
    limits[5] = limits[30] = 60  # the longest two
    shapes = []
    decoder = Decoder(model, float_mask=False, compact=compact)
    wider = decoder._step
    decoder._step = lambda rows, length: shapes.append(rows) or wider(rows, length)
    free = [r[0] for r in run(Decoder(model, float_mask=False, compact=0), prompts, limits)]
    options = dict(
        limits=limits, eos=[free[30][40]], stop_hit=lambda tokens: tokens[-2:] == free[5][44:46]
    )
    for every in (1, 16):
        shapes.clear()
        still = run(
            Decoder(model, float_mask=False, compact=0), prompts, read_every=every, **options
        )
        moved = run(decoder, prompts, read_every=every, **options)
        assert shapes == widths, shapes  # it did move
        assert max(n for _, _, n, _ in still) > 40 and any(s == "stop" for *_, s in still)
        for (tokens, logprobs, n, stopped), expected in zip(moved, still, strict=True):
            assert (tokens, n, stopped) == (expected[0], expected[2], expected[3])
            assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected[1]), atol=1e-5)


def test_a_cut_call_and_its_continuation_give_each_sample_what_one_call_gives_it(model):
    """Partial rollouts: with cut_below, the call ends once no prompt waits and few rows run;
    those rows return a prefix of their sample ("abort"). Continued from prompt + prefix with
    `carried`, each draws on where it stopped: tokens, length and finish are the uncut call's,
    logprobs to float rounding (prefill against decode). A `final` row is never cut."""
    import random

    draw = random.Random(3)
    prompts = [PROMPTS[k % 4] + [k + 1] for k in range(24)]
    limits = [min(50, 2 + int(draw.expovariate(1 / 8))) for _ in prompts]
    limits[3], limits[17], limits[20] = 50, 45, 40  # the tail
    free = [r[0] for r in run(Decoder(model, float_mask=False), prompts, limits)]
    options = dict(
        limits=limits, eos=[free[3][30]], stop_hit=lambda tokens: tokens[-2:] == free[17][38:40]
    )
    full = run(Decoder(model, float_mask=False), prompts, **options)
    for every in (1, 4):
        cut = run(
            Decoder(model, float_mask=False), prompts, read_every=every, cut_below=4, **options
        )
        aborted = [i for i, r in enumerate(cut) if r[3] == "abort"]
        assert 1 <= len(aborted) <= 3, [r[2:] for r in cut]
        for i, (tokens, logprobs, n, finish) in enumerate(cut):
            if i not in aborted:
                assert (tokens, n, finish) == (full[i][0], full[i][2], full[i][3])
                continue
            assert n < full[i][2] and tokens == full[i][0][:n]  # a prefix of its sample
            more = run(
                Decoder(model, float_mask=False),
                [prompts[i] + tokens],
                limits=[limits[i] - n],
                keys=[i],
                carried=[n],
                eos=options["eos"],
                stop_hit=options["stop_hit"],
            )[0]
            assert (tokens + more[0], n + more[2], more[3]) == (
                full[i][0],
                full[i][2],
                full[i][3],
            )
            joined = torch.tensor(logprobs + more[1])
            assert torch.allclose(joined, torch.tensor(full[i][1]), atol=1e-5)
        final = [i in aborted for i in range(len(prompts))]
        kept = run(Decoder(model, float_mask=False), prompts, cut_below=4, final=final, **options)
        assert [r[3] for r in kept] == [r[3] for r in full]


def _cut_and_continue(decoder, prompts, limits, fresh=(), between=None, **options):
    """One call cut at 4 rows, then (after `between()`) one call of its cut samples continued
    and `fresh` prompts, on the same decoder; the prompts each call prefilled (from their
    groups' forwards), the cut call's results and the continuation's."""
    from ferrule_rollout import decode

    prefilled = []
    with pytest.MonkeyPatch.context() as patch:
        take = decode._Rows.take
        patch.setattr(
            decode._Rows,
            "take",
            lambda rows, t, at, taken, s: (
                prefilled[-1].extend(taken) or take(rows, t, at, taken, s)
            ),
        )
        prefilled.append([])
        cut = run(decoder, prompts, limits=limits, cut_below=4, **options)
        if between is not None:
            prefilled.append([])
            between()
        aborted = [i for i, r in enumerate(cut) if r[3] == "abort"]
        more = [prompts[i] + cut[i][0] for i in aborted] + list(fresh)
        prefilled.append([])
        went_on = run(
            decoder,
            more,
            limits=[limits[i] - cut[i][2] for i in aborted] + [limits[0]] * len(fresh),
            keys=aborted + [100 + k for k in range(len(fresh))],
            carried=[cut[i][2] for i in aborted] + [0] * len(fresh),
            **options,
        )
    return (prefilled[0], prefilled[-1]), cut, aborted, went_on


def test_a_cut_row_resumed_in_place_gives_the_uncut_sample_without_a_prefill(model):
    """reuse_cut: the rows a cut call leaves keep their keys and values, and the next call on
    the same decoder that continues those sequences resumes them in their rows: only its fresh
    prompts are prefilled, and each continued sample is the uncut call's, token for token. A
    call in between that does not continue them frees their rows: they are prefilled again."""
    import random

    draw = random.Random(3)
    prompts = [PROMPTS[k % 4] + [k + 1] for k in range(24)]
    limits = [min(50, 2 + int(draw.expovariate(1 / 8))) for _ in prompts]
    limits[3], limits[17], limits[20] = 50, 45, 40  # the tail
    full = run(Decoder(model, float_mask=False), prompts, limits=limits)
    fresh = [PROMPTS[1] + [77], PROMPTS[2]]
    for between in (None, "another call"):
        decoder = Decoder(model, float_mask=False, reuse_cut=True)
        other = None if between is None else lambda d=decoder: run(d, PROMPTS, limits=[30] * 4)
        prefilled, cut, aborted, went_on = _cut_and_continue(
            decoder, prompts, limits, fresh, between=other
        )
        assert 1 <= len(aborted) <= 3 and sorted(prefilled[0]) == list(range(24))
        continued = list(range(len(aborted)))
        assert sorted(prefilled[1]) == (continued if between else []) + [
            len(aborted),
            len(aborted) + 1,
        ]
        for k, i in enumerate(aborted):
            tokens, logprobs, n, finish = went_on[k]
            assert (cut[i][0] + tokens, cut[i][2] + n, finish) == (
                full[i][0],
                full[i][2],
                full[i][3],
            )
            joined = torch.tensor(cut[i][1] + logprobs)
            assert torch.allclose(joined, torch.tensor(full[i][1]), atol=1e-5)
        fresh_alone = run(
            Decoder(model, float_mask=False), fresh, limits=[limits[0]] * 2, keys=[100, 101]
        )
        assert [r[0] for r in went_on[len(aborted) :]] == [r[0] for r in fresh_alone]


def test_a_resumed_row_keeps_the_keys_and_values_of_the_weights_that_wrote_them(model, eager):
    """What reuse_cut means under a weight update between the calls: the continued sample's
    earlier keys and values are the old weights' (not recomputed), and the logprob recorded
    for its next token is the one it was drawn with under the new weights over them; a
    decoder without reuse_cut prefills the sequence under the new weights instead."""
    import copy

    from transformers import DynamicCache

    prompts = [PROMPTS[k % 4] + [k + 1] for k in range(6)]
    limits = [2, 3, 2, 40, 3, 2]
    ours, old = copy.deepcopy(model), eager

    def update():  # the same new weights in the decoder's model and the reference's
        with torch.no_grad():
            for p in ours.parameters():
                p.mul_(1.25)

    firsts = {}
    for reuse in (True, False):
        ours.load_state_dict(model.state_dict())
        decoder = Decoder(ours, float_mask=False, reuse_cut=reuse)
        _, cut, aborted, went_on = _cut_and_continue(decoder, prompts, limits, between=update)
        assert aborted == [3]
        firsts[reuse] = went_on[0][0][0], went_on[0][1][0]  # its first new token, logprob
    sequence = prompts[3] + cut[3][0]
    new = copy.deepcopy(eager)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.25)
        cache = DynamicCache(config=old.config)
        old(torch.tensor([sequence[:-1]]), past_key_values=cache, use_cache=True)
        logits = new(
            torch.tensor([sequence[-1:]]),
            past_key_values=cache,
            position_ids=torch.tensor([[len(sequence) - 1]]),
        ).logits[0, -1]
        recomputed = new(torch.tensor([sequence])).logits[0, -1]
    stale, fresh = logits.log_softmax(-1), recomputed.log_softmax(-1)
    (token, logprob), (other, recorded) = firsts[True], firsts[False]
    assert logprob == pytest.approx(stale[token].item(), abs=1e-5)
    assert recorded == pytest.approx(fresh[other].item(), abs=1e-5)
    assert abs(stale[token] - fresh[token]) > 1e-3  # the two differ: the test tells them apart


def test_prompts_are_prefilled_in_groups_and_windows_within_their_budgets(model, eager):
    """Continued samples make prompts thousands of tokens long among short ones: one prefill
    padding every prompt to the longest, over the slab's every slot, ran out of memory at 1.5B.
    Prefill groups hold at most PREFILL_TOKENS padded tokens (a longer prompt alone) and attend
    to their own columns only (a causal forward, no mask); under a float mask they go in
    windows of columns of at most PREFILL_SCORES scores (rows x window x slots before its end).
    Every sample is unchanged."""
    from ferrule_rollout import decode

    prompts = [PROMPTS[k % 4] + [k] for k in range(9)] + [list(range(100, 190))]
    limits = [12] * len(prompts)
    cases = (
        (model, False, 1 << 24, (1, 90)),
        (eager, True, 1 << 24, (1, 90)),
        (eager, True, 600, (1, 6)),
    )
    for net, float_mask, scores, longest in cases:
        whole = run(Decoder(net, float_mask=float_mask), prompts, limits=limits)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decode, "PREFILL_TOKENS", 40)
            patch.setattr(decode, "PREFILL_SCORES", scores)
            decoder, shapes = Decoder(net, float_mask=float_mask), []
            prefill = decoder.forward  # decode steps call step_forward, bound before this patch

            def forward(ids, positions, pad_ok, *args, shapes=shapes, prefill=prefill, **options):
                shapes.append((*ids.shape, pad_ok.shape[1], options.get("causal", False)))
                return prefill(ids, positions, pad_ok, *args, **options)

            decoder.forward = forward
            got = run(decoder, prompts, limits=limits)
        assert len(shapes) > 2 and all(r * w <= 40 or r == 1 for r, w, *_ in shapes), shapes
        if float_mask:
            assert all(r * w * seen <= scores or w == 1 for r, w, seen, _ in shapes), shapes
            assert not any(causal for *_, causal in shapes)
        else:  # one causal forward over its own columns: sdpa's flash kernel on CUDA
            assert all(seen == w and causal for _, w, seen, causal in shapes), shapes
        assert longest in [(r, w) for r, w, *_ in shapes]  # the long prompt alone (in windows)
        for (tokens, logprobs, n, finish), expected in zip(got, whole, strict=True):
            assert (tokens, n, finish) == (expected[0], expected[2], expected[3])
            assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected[1]), atol=1e-5)
        for prompt, (tokens, logprobs, *_) in zip(prompts, got, strict=True):
            expected, _ = teacher_forced(net, prompt, tokens, 1.0)
            assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)


def test_the_slab_is_as_long_as_the_longest_sequence_not_the_widest_prompt_plus_the_most_tokens(
    model,
):
    """A continued sample's prompt is long and its limit short, a new prompt the other way:
    the slab needs the longest prompt + limit (94 slots here, 128 aligned), not the widest
    prompt + the largest limit (149, 192 aligned): at 1.5B that asked 6.5k slots of a 4160-slot
    engine and ran out of memory."""
    decoder = Decoder(model, float_mask=False)
    results = run(decoder, [list(range(100, 190)), [40, 41]], limits=[4, 60])
    assert [n for _, _, n, _ in results] == [4, 60]
    assert decoder.cache.table.shape[1] * PAGE == 128


def test_causal_prefill_leaves_cudnn_out_of_sdpas_choice(model, monkeypatch):
    """cuDNN's attention, torch's first choice on Hopper, builds a plan for each new shape (76 ms
    on an H200 against 2 ms for flash) and prefill groups change shape with every call: prefill
    runs with it switched off, decode and whatever runs after as before."""
    from ferrule_rollout import decode

    seen = []
    sdpa = decode.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(decode.F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    results = run(Decoder(model, float_mask=False), limits=[4] * len(PROMPTS))
    assert seen and not any(seen[: model.config.num_hidden_layers])  # the prefill's layers
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert [n for *_, n, _ in results] == [4] * len(PROMPTS)


def test_a_pool_smaller_than_the_rows_makes_rows_wait_and_gives_the_same_samples(
    model, monkeypatch
):
    """A pool of 4 pages (256 tokens) for 3 rows of up to 192 slots (3 pages each): three short
    prompts start together, outgrow the pool past slot 64, and the rows started last go back
    to the queue and run again later; the long prompt waits until pages are free. Every sample
    equals the one a pool of rows x their longest gives (the draws are keyed), no more pages
    are ever held than the pool has, and a pool that cannot hold one sequence is refused."""
    from ferrule_rollout import decode

    prompts = [[5, 6, 7], [40, 41], list(range(100, 190)), [7]]
    limits = [120, 140, 40, 100]
    roomy = run(Decoder(model, float_mask=False), prompts, limits, max_rows=3)
    held, cover = [], decode.SlabCache.cover

    def watched(cache, *args):
        granted = cover(cache, *args)
        held.append(sum(map(len, cache.owned)))
        return granted

    monkeypatch.setattr(decode.SlabCache, "cover", watched)
    tight = Decoder(model, float_mask=False, kv_tokens=4 * PAGE)
    for (tokens, logprobs, *end), (want, wanted, *want_end) in zip(
        run(tight, prompts, limits, max_rows=3), roomy, strict=True
    ):
        assert (tokens, end) == (want, want_end)
        assert max(abs(a - b) for a, b in zip(logprobs, wanted, strict=True)) < 1e-5
    assert tight.requeued > 0 and max(held) <= 4
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        run(Decoder(model, float_mask=False, kv_tokens=2 * PAGE), prompts, limits, max_rows=3)
