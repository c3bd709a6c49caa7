"""The forward passes' pieces: the rows' layout, response log-probs."""

import pytest
import torch

from ferrule_trainer.sequences import token_logprobs


def test_token_logprobs_is_log_softmax_with_temperature():
    logits = torch.randn(2, 3, 7)
    tokens = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature=0.7), expected)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0)


def _rl_batch(rows: int = 5, prompt: int = 6, response: int = 7, seed: int = 0):
    """Left-padded prompts, right-padded responses of unlike lengths (one of a single token)."""
    from ferrule_trainer.batch import Batch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 300, (rows, prompt + response), generator=generator)
    attention = torch.zeros_like(ids)
    for row in range(rows):
        start = int(torch.randint(0, prompt - 1, (1,), generator=generator))
        end = prompt + (
            1 if row == 0 else int(torch.randint(1, response + 1, (1,), generator=generator))
        )
        attention[row, start:end] = 1
    return Batch(ids, attention, attention[:, prompt:].clone())


@pytest.mark.parametrize(
    ("packed", "compiled"), [(False, False), (True, False), (False, True)], ids=str
)
def test_response_logprobs_equal_the_whole_logits_in_values_and_gradients(
    monkeypatch, packed, compiled
):
    """The LM head on chunks of 4 tokens (a short last one), each recomputed in backward, gives
    the log-probabilities, entropies and gradients of the whole (B, R, vocab) logits; so does
    its softmax compiled (a model marked as compile_decoder_layers marks it; inductor on CPU)."""
    from transformers import AutoModelForCausalLM

    from ferrule_testkit import tiny_model
    from ferrule_trainer import sequences
    from ferrule_trainer.losses import token_entropy
    from ferrule_trainer.sequences import response_logits, response_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    batch = _rl_batch()
    real = batch.attention_mask[:, -batch.response_len :].bool()
    weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(1))

    def gradients(logprobs, entropy):
        model.zero_grad()
        ((logprobs * weights)[real].sum() + (entropy * weights)[real].sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits = response_logits(model, batch, packed).float() / 0.7
    expected = token_logprobs(logits, batch.response_tokens)
    expected_entropy = token_entropy(logits)
    expected_grads = gradients(expected, expected_entropy)

    monkeypatch.setattr(sequences, "HEAD_CHUNK", 4)
    calls = []
    if compiled:
        setattr(model, sequences.COMPILED_HEAD, True)
        chunk = sequences._compiled_head_logprobs()
        monkeypatch.setattr(
            sequences, "_compiled_head_logprobs", lambda: lambda *a: calls.append(1) or chunk(*a)
        )
    logprobs, entropy = response_logprobs(model, batch, 0.7, packed=packed, entropy=True)
    assert int(real.sum()) > 2 * sequences.HEAD_CHUNK  # several chunks
    assert bool(calls) == compiled
    torch.testing.assert_close(logprobs[real], expected[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[real], expected_entropy[real], rtol=1e-5, atol=1e-5)
    assert not logprobs[~real].any() and not entropy[~real].any()
    grads = gradients(logprobs, entropy)
    assert grads.keys() == expected_grads.keys()
    assert "model.embed_tokens.weight" in grads  # the tied head's gradient reaches it
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=2e-6, msg=name)
    # the head is itself again afterwards
    assert model.get_output_embeddings()(torch.ones(1, model.config.hidden_size)).shape[-1] > 1
    with torch.no_grad():
        no_grad, none = response_logprobs(model, batch, 0.7, packed=packed)
    assert none is None
    torch.testing.assert_close(no_grad, logprobs.detach())


def test_response_logprobs_keep_a_replaced_head_forward_and_refuse_a_zero_temperature():
    """Exact mode replaces the head's forward on the instance; it is the one in place after."""
    from transformers import AutoModelForCausalLM

    from ferrule_testkit import tiny_model
    from ferrule_trainer.sequences import response_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    head = model.get_output_embeddings()
    calls = []
    original = head.forward

    def counted(x):
        calls.append(x.shape)
        return original(x)

    head.forward = counted
    response_logprobs(model, _rl_batch())
    assert head.forward is counted and calls  # the chunks went through the replaced forward
    with pytest.raises(ValueError, match="temperature"):
        response_logprobs(model, _rl_batch(), 0.0)


@pytest.mark.parametrize(
    "device",
    [pytest.param("cpu", marks=pytest.mark.e2e), pytest.param("cuda", marks=pytest.mark.gpu)],
)  # on the CPU inductor compiles C++: ~23 s on 2 cores, the e2e tier
def test_compiled_layers_compile_once_for_any_width_with_or_without_padding(monkeypatch, device):
    """Token budgets give micro-batches of every width, some without padding. Compiled layers
    used to specialise on both (a None mask; on CUDA, a width that is a multiple of 8 or not)
    and on a single row (a long response alone in its budget): each new case recompiled every
    layer mid-run, ~9 s at 1.5B on four GPUs (2026-11-28). The forwards' inputs now always
    take one form."""
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    from ferrule_testkit import tiny_model
    from ferrule_trainer.batch import Batch
    from ferrule_trainer.engine import compile_decoder_layers
    from ferrule_trainer.sequences import response_logprobs, response_values

    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    reference.load_state_dict(model.state_dict())
    model.to(device)
    reference.to(device)
    assert compile_decoder_layers(model) == model.config.num_hidden_layers
    full = torch.randint(1, 300, (3, 9), generator=torch.Generator().manual_seed(2))
    unpadded = Batch(full, torch.ones_like(full), torch.ones(3, 4, dtype=torch.long))
    batches = [  # widths 9, 16, 13, 8, 13; rows 3, 4, 5, 5, 1
        unpadded,
        _rl_batch(rows=4, prompt=6, response=10),
        _rl_batch(),
        _rl_batch(prompt=5, response=3),
        _rl_batch(rows=1),
    ]
    for index, batch in enumerate(batch.to(device) for batch in batches):
        logprobs, _ = response_logprobs(model, batch)
        logprobs.sum().backward()  # the backward graph compiles once too
        with torch.no_grad():
            expected, _ = response_logprobs(reference, batch)
        real = batch.response_mask.bool()
        torch.testing.assert_close(logprobs[real], expected[real], rtol=1e-4, atol=1e-4)
        assert response_values(model, batch).shape == batch.response_mask.shape
        if index == 0:  # the first forward compiled; from here on, none may
            monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)


@pytest.fixture
def sdpa_calls(monkeypatch) -> list:
    """(its attn_mask, whether cuDNN's kernel was allowed) of each sdpa call from here on."""
    seen = []
    sdpa_function = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask"), torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa_function(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def test_rows_start_at_column_0_and_attend_with_no_mask_and_without_cudnn(sdpa_calls):
    """The batch's layout (prompts left-padded) would need an attention mask, under which sdpa
    runs cuDNN's kernel (a plan built for each new shape; NaN in the backward of queries that see
    no key, issue 56) or the memory-efficient one. Each row's tokens now start at column 0 and
    attention is causal with no mask and without cuDNN, in the forward and in gradient
    checkpointing's recomputation; real tokens get what eager attention gives them over the
    left-padded batch with transformers' own mask."""
    from transformers import AutoModelForCausalLM

    from ferrule_testkit import tiny_model
    from ferrule_trainer.batch import Batch
    from ferrule_trainer.engine import load_model
    from ferrule_trainer.sequences import model_inputs, response_logprobs

    ids = torch.randint(5, 400, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :6] = 0  # a prompt of one token
    mask[0, -1] = 0  # a response that ends early
    batch = Batch(ids, mask, mask[:, -3:].clone())
    sdpa = load_model(tiny_model("qwen2"), dtype="float32", gradient_checkpointing=True)
    assert sdpa.config._attn_implementation == "sdpa"
    inputs = model_inputs(sdpa, batch)
    assert sorted(inputs) == ["index", "input_ids"]  # no mask, positions from 0
    assert inputs["input_ids"].tolist() == [
        ids[0, :9].tolist(),
        [*ids[1, 4:].tolist(), 0, 0, 0],
        [*ids[2, 6:].tolist(), *[0] * 5],
    ]
    assert inputs["index"].tolist() == [[6, 7, 8], [2, 3, 4], [0, 1, 2]]

    sdpa.train()
    seen = sdpa_calls
    ours, _ = response_logprobs(sdpa, batch)
    forwards = len(seen)
    ours.sum().backward()
    assert forwards == sdpa.config.num_hidden_layers and len(seen) == 2 * forwards  # recomputed
    assert all(mask is None and not cudnn for mask, cudnn in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # as it was, outside the forwards

    eager = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), attn_implementation="eager")
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # counted over real tokens
        logits = eager(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    theirs = token_logprobs(logits[:, -4:-1], batch.response_tokens)
    real = batch.response_mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)
    assert not ours[~real].any()


def test_the_offline_trainers_forwards_take_no_mask_and_give_the_masked_results(sdpa_calls):
    """SFT, DPO and reward-model batches are right-padded (SequenceBatch): their forwards pass
    no mask, so sdpa runs its causal kernel, without cuDNN; the loss, the log-probabilities and
    the scores are what the forward with transformers' padding mask gives."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ferrule_testkit import tiny_model
    from ferrule_trainer import dpo, sft
    from ferrule_trainer.batch import SequenceBatch
    from ferrule_trainer.rm import RewardModel

    path = tiny_model("qwen2")
    lm = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    scorer = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    pad = scorer.config.pad_token_id = 0
    ids = torch.randint(5, 400, (4, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row, length in enumerate((9, 6, 4, 7)):
        mask[row, length:] = 0
    ids = ids.masked_fill(mask == 0, pad)
    loss_mask = mask.clone()
    loss_mask[:, :2] = 0
    batch = SequenceBatch(ids, mask, loss_mask)

    def masked(model):  # the forward as it was: transformers' padding mask
        return lambda **kw: model(input_ids=kw["input_ids"], attention_mask=mask, use_cache=False)

    expected_loss = sft.sft_loss(masked(lm), batch, loss_mask[:, 1:].sum())
    expected_logprobs, counts = dpo.response_logprobs(masked(lm), batch)
    expected_scores = RewardModel.scores(SimpleNamespace(engine=masked(scorer)), batch)
    seen = sdpa_calls
    seen.clear()

    loss = sft.sft_loss(lm, batch, loss_mask[:, 1:].sum())
    logprobs, same_counts = dpo.response_logprobs(lm, batch)
    scores = RewardModel.scores(SimpleNamespace(engine=scorer), batch)
    assert len(seen) == 3 * lm.config.num_hidden_layers
    assert all(mask is None and not cudnn for mask, cudnn in seen)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, same_counts)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)
