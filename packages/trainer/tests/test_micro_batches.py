"""Micro-batches by a token budget ([trainer] micro_batch_tokens) and packed sequences
(pack_sequences): the same log-probabilities, values, losses and gradients as one whole batch,
in the batch's row order."""

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_trainer.batch import Batch
from ferrule_trainer.config import TrainerConfig
from ferrule_trainer.sequences import plan_micro_batches
from ferrule_trainer.settings import EpochPlan, ForwardPlan, PolicyLoss, PreferenceLoss, ValueLoss

B, T, R = 8, 24, 10


def _batch(seed: int = 0) -> Batch:
    """Rows of unlike lengths: left-padded prompts of 3-14 tokens, right-padded responses of
    1-10, one response with tokens an environment inserted (attended to, no loss)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 500, (B, T), generator=generator)
    attention = torch.zeros(B, T, dtype=torch.long)
    prompts = torch.randint(3, T - R + 1, (B,), generator=generator)
    responses = torch.randint(1, R + 1, (B,), generator=generator)
    responses[2] = R  # one full-length response
    for row in range(B):
        attention[row, T - R - prompts[row] : T - R + responses[row]] = 1
    response_mask = attention[:, -R:].clone()
    response_mask[2, 3:5] = 0  # an environment's tokens
    advantages = torch.randn(B, R, generator=generator)
    return Batch(ids, attention, response_mask, advantages=advantages)


def _padded_cost(batch, rows):
    prompt, response = batch.lengths()
    prompt, response = prompt[rows], response[rows]
    return len(rows) * (int(prompt.max()) + int(response.max()))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("max_tokens, max_rows", [(60, 8), (100, 3), (1, 8), (10_000, 8)])
def test_the_plan_covers_every_row_once_within_the_budget_and_the_row_bound(
    max_tokens, max_rows, packed
):
    batch = _batch()
    plan = plan_micro_batches(batch, max_rows=max_rows, max_tokens=max_tokens, packed=packed)
    assert sorted(row for rows in plan for row in rows) == list(range(B))
    prompt, response = batch.lengths()
    for rows in plan:
        assert len(rows) <= max_rows
        if len(rows) > 1:  # a row over the budget goes alone
            real = int((prompt[rows] + response[rows]).sum())
            assert (real if packed else _padded_cost(batch, rows)) <= max_tokens
    if max_tokens == 1:
        assert all(len(rows) == 1 for rows in plan)
    if max_tokens == 10_000:
        assert len(plan) == -(-B // max_rows)


def test_the_plan_sorts_rows_by_length_and_keeps_units_together():
    batch = _batch()
    prompt, response = batch.lengths()
    lengths = (prompt + response).tolist()
    plan = plan_micro_batches(batch, max_rows=3, max_tokens=10_000)
    order = [row for rows in plan for row in rows]
    assert [lengths[row] for row in order] == sorted(lengths, reverse=True)
    pairs = plan_micro_batches(batch, max_rows=4, max_tokens=70, unit=2)
    for rows in pairs:  # whole pairs, chosen (even) before rejected (odd)
        assert all(rows[i] % 2 == 0 and rows[i + 1] == rows[i] + 1 for i in range(0, len(rows), 2))
        assert len(rows) == 2 or _padded_cost(batch, rows) <= 70


def test_take_drops_the_columns_that_are_padding_in_every_row_it_takes():
    batch = _batch()
    prompt, response = batch.lengths()
    rows = [1, 5]
    part = batch.take(rows)
    p, r = int(prompt[rows].max()), int(response[rows].max())
    assert part.input_ids.shape == (2, p + r) and part.response_mask.shape == (2, r)
    assert part.advantages.shape == (2, r)
    torch.testing.assert_close(part.input_ids, batch.input_ids[rows][:, T - R - p : T - R + r])
    torch.testing.assert_close(part.advantages, batch.advantages[rows][:, :r])
    assert int(part.attention_mask.sum()) == int(batch.attention_mask[rows].sum())


@pytest.fixture(scope="module")
def actor():
    from ferrule_trainer.actor import Actor

    return Actor(tiny_model("qwen2"), train=False, zero_stage=0, dtype="float32", temperature=0.7)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tokens, rows", [(60, None), (100, 3), (1, None), (10_000, 2)])
def test_logprobs_by_tokens_equal_the_whole_batch_in_row_order(actor, tokens, rows, packed):
    """Sorted, split (a budget of 1 token: one row each), trimmed and packed: the old policy's and
    the reference's log-probabilities come back in the batch's order, 0 on padding."""
    batch = _batch()
    whole = actor.logprobs(batch)
    by_tokens = actor.logprobs(batch, ForwardPlan(rows, micro_batch_tokens=tokens, packed=packed))
    real = batch.attention_mask[:, -R:].bool()
    torch.testing.assert_close(by_tokens[real], whole[real], rtol=1e-5, atol=1e-5)
    assert (by_tokens[~real] == 0).all()


def test_packed_rows_do_not_attend_to_each_other(actor):
    """The document mask of a packed row: changing one sequence's tokens changes nothing of the
    others' log-probabilities (without it, every later sequence would read the earlier ones)."""
    batch = _batch()
    other = batch.replace(input_ids=batch.input_ids.clone())
    other.input_ids[0] = (other.input_ids[0] + 7) % 500
    packed = ForwardPlan(micro_batch_tokens=10_000, packed=True)
    one, two = actor.logprobs(batch, packed), actor.logprobs(other, packed)
    torch.testing.assert_close(one[1:], two[1:], rtol=0, atol=0)
    assert not torch.equal(one[0], two[0])


def test_critic_values_by_tokens_equal_the_whole_batch():
    from ferrule_trainer.critic import Critic

    critic = Critic(tiny_model("qwen2"), zero_stage=0, dtype="float32")
    batch = _batch()
    whole = critic.values(batch)
    real = batch.attention_mask[:, -R:].bool()
    for tokens, packed in [(50, False), (1, False), (50, True)]:
        by_tokens = critic.values(batch, ForwardPlan(4, micro_batch_tokens=tokens, packed=packed))
        torch.testing.assert_close(by_tokens[real], whole[real], rtol=1e-5, atol=1e-5)


def _with_gradients(model):
    """Records the gradients each optimizer step applies (ZeRO-0, fp32: they are the .grad of
    the parameters when `engine.step` is called)."""
    seen = []
    step = model.engine.step

    def recording_step(*args, **kwargs):
        grads = {
            n: p.grad.clone()
            for n, p in model.engine.module.named_parameters()
            if p.grad is not None
        }
        seen.append(grads)
        return step(*args, **kwargs)

    model.engine.step = recording_step
    return seen


def _assert_same_steps(ours, theirs, ours_grads, theirs_grads):
    # a second mini-batch's loss follows an Adam step, which moves a weight whose gradient is
    # ~0 by about the learning rate either way: rounding-level logprobs (~1e-6 apart) moved a
    # two-mini-batch loss by 1.2e-5 of itself when the rows' layout changed
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=5e-5, abs=1e-7)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    assert len(ours_grads) == len(theirs_grads) > 0
    for mine, whole in zip(ours_grads, theirs_grads, strict=True):
        assert mine.keys() == whole.keys()
        # to float32 rounding of sums in another order: on one 2-core machine a critic's
        # gradient element differed by 1.4e-4 of its tensor's largest (on the old code too)
        for name in whole:
            scale = float(whole[name].abs().max())
            torch.testing.assert_close(mine[name], whole[name], rtol=1e-4, atol=5e-4 * scale)


POLICY_CASES = [
    dict(),  # on-policy: the training forward supplies the old log-probabilities
    dict(old=True, kl_coef=0.05, entropy_coef=0.01),
    dict(old=True, agg_mode="seq-mean-token-mean", mini_batches=2),
    dict(old=True, agg_mode="seq-mean-token-sum", ratio_level="sequence", clip_low=3e-4),
]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: "-".join(map(str, c.items())))
def test_a_policy_step_by_tokens_equals_the_step_over_the_whole_batch(case, packed):
    from ferrule_trainer.actor import Actor

    case = dict(case)
    model = tiny_model("qwen2")
    common = dict(dtype="float32", zero_stage=0, seed=0, temperature=0.7, learning_rate=1e-2)
    whole, by_tokens = Actor(model, **common), Actor(model, **common)
    batch = _batch()
    generator = torch.Generator().manual_seed(1)
    old = whole.logprobs(batch) - 0.1 * torch.rand(B, R, generator=generator)
    if case.pop("old", False):
        batch = batch.replace(old_logprobs=old)
    if case.get("kl_coef"):
        batch = batch.replace(ref_logprobs=old + 0.1 * torch.randn(B, R, generator=generator))
    else:
        batch = batch.replace(rollout_logprobs=old)
    mini = case.pop("mini_batches", 1)
    loss = PolicyLoss(**case)
    grads_whole, grads_tokens = _with_gradients(whole), _with_gradients(by_tokens)

    reference = whole.train_epochs(batch, EpochPlan(1, mini, micro_batch_size=B), loss)
    plan = EpochPlan(1, mini, micro_batch_size=3, micro_batch_tokens=50, pack_sequences=packed)
    ours = by_tokens.train_epochs(batch, plan, loss)

    _assert_same_steps(ours, reference, grads_tokens, grads_whole)
    assert len(grads_whole) == mini
    for key in ("vllm_kl", "kl", "clip_fraction", "approx_kl"):  # per token, however split
        if key in reference:
            assert ours[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("agg_mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_response_masked_whole_changes_no_seq_mean_step(agg_mode):
    """Issue 59, item 9: the step over a batch with one response masked whole (a filtered or
    failed sample) is the step over the batch without that row: the sequences counted are
    those with a valid token, on every rank and micro-batch."""
    from ferrule_trainer.actor import Actor

    model = tiny_model("qwen2")
    common = dict(dtype="float32", zero_stage=0, seed=0, temperature=0.7, learning_rate=1e-2)
    with_row, without = Actor(model, **common), Actor(model, **common)
    batch = _batch()
    old = with_row.logprobs(batch) - 0.1 * torch.rand(
        B, R, generator=torch.Generator().manual_seed(2)
    )
    batch = batch.replace(old_logprobs=old)
    masked = batch.replace(response_mask=batch.response_mask.clone())
    masked.response_mask[5] = 0
    plan, loss = EpochPlan(micro_batch_size=3), PolicyLoss(agg_mode=agg_mode)
    grads_with, grads_without = _with_gradients(with_row), _with_gradients(without)
    ours = with_row.train_epochs(masked, plan, loss)
    theirs = without.train_epochs(batch.take([0, 1, 2, 3, 4, 6, 7]), plan, loss)
    _assert_same_steps(ours, theirs, grads_with, grads_without)


def test_the_step_metrics_are_token_means_however_the_rows_are_split():
    """clip_fraction and approx_kl are means over the step's tokens: micro-batches of unlike
    token counts (rows of unlike length, or split by tokens) weigh by their tokens. Before,
    each micro-batch's own mean counted once: 3 rows of 30 tokens weighed as 1 row of 2."""
    from ferrule_trainer.actor import Actor
    from ferrule_trainer.critic import Critic

    model = tiny_model("qwen2")
    common = dict(dtype="float32", zero_stage=0, seed=0, learning_rate=1e-2)
    batch = _batch()
    generator = torch.Generator().manual_seed(4)
    actors = Actor(model, **common), Actor(model, **common)
    old = actors[0].logprobs(batch) - 0.3 * torch.rand(B, R, generator=generator)
    batch = batch.replace(old_logprobs=old)
    loss = PolicyLoss(clip_low=0.05, clip_high=0.05)
    whole = actors[0].train_epochs(batch, EpochPlan(micro_batch_size=B), loss)
    by_rows = actors[1].train_epochs(batch, EpochPlan(micro_batch_size=3), loss)
    assert 0 < whole["clip_fraction"] < 1
    for key in ("clip_fraction", "approx_kl"):
        assert by_rows[key] == pytest.approx(whole[key], rel=1e-4), key
    critics = Critic(model, **common), Critic(model, **common)
    old_values = critics[0].values(batch) + 0.3 * torch.randn(B, R, generator=generator)
    returns = old_values + torch.randn(B, R, generator=generator)
    values = batch.replace(old_values=old_values, returns=returns)  # some move past the 0.2 clip
    whole = critics[0].train_epochs(values, EpochPlan(micro_batch_size=B), ValueLoss())
    by_rows = critics[1].train_epochs(values, EpochPlan(micro_batch_size=3), ValueLoss())
    assert 0 < whole["value_clip_fraction"] < 1
    assert by_rows["value_clip_fraction"] == pytest.approx(whole["value_clip_fraction"], rel=1e-4)


def test_sft_and_dpo_steps_by_tokens_equal_the_whole_batch():
    """The recipes' steps (rejection sampling's likelihood, iterative DPO's pairs, split by
    tokens in whole pairs) give the same loss and gradients as well."""
    from ferrule_trainer.actor import Actor

    model = tiny_model("qwen2")
    common = dict(dtype="float32", zero_stage=0, seed=0, learning_rate=1e-2)
    batch = _batch()
    batch = batch.replace(
        ref_logprobs=-torch.rand(B, R, generator=torch.Generator().manual_seed(2))
    )
    dpo = PreferenceLoss(beta=0.1, nll_coef=0.5)
    for method, loss, tokens, packed in [
        ("likelihood_epochs", (), 60, True),
        ("preference_epochs", (dpo,), 60, True),
        ("preference_epochs", (dpo,), 80, False),  # 2, 2 and 4 rows
    ]:
        whole, by_tokens = Actor(model, **common), Actor(model, **common)
        grads_whole, grads_tokens = _with_gradients(whole), _with_gradients(by_tokens)
        reference = getattr(whole, method)(batch, EpochPlan(micro_batch_size=B), *loss)
        plan = EpochPlan(micro_batch_size=4, micro_batch_tokens=tokens, pack_sequences=packed)
        ours = getattr(by_tokens, method)(batch, plan, *loss)
        _assert_same_steps(ours, reference, grads_tokens, grads_whole)
        for key in ("accuracy", "margin", "chosen_nll"):  # means over pairs, however split
            if key in reference:
                assert ours[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tokens", [40, 1])  # 1: every row alone, over the budget
def test_a_critic_step_by_tokens_equals_the_step_over_the_whole_batch(tokens, packed):
    from ferrule_trainer.critic import Critic

    common = dict(zero_stage=0, dtype="float32", learning_rate=1e-2)
    whole, by_tokens = Critic(tiny_model("qwen2"), **common), Critic(tiny_model("qwen2"), **common)
    batch = _batch()
    returns = torch.randn(B, R, generator=torch.Generator().manual_seed(3))
    batch = batch.replace(old_values=whole.values(batch), returns=returns)
    grads_whole, grads_tokens = _with_gradients(whole), _with_gradients(by_tokens)
    for agg_mode in ("token-mean", "seq-mean-token-mean"):
        loss = ValueLoss(clip=0.2, agg_mode=agg_mode)
        reference = whole.train_epochs(batch, EpochPlan(micro_batch_size=B), loss)
        plan = EpochPlan(micro_batch_size=B, micro_batch_tokens=tokens, pack_sequences=packed)
        ours = by_tokens.train_epochs(batch, plan, loss)
        _assert_same_steps(ours, reference, grads_tokens[-1:], grads_whole[-1:])


def test_the_trainer_table_sets_the_budgets_of_every_pass():
    t = TrainerConfig()
    assert t.epoch_plan().micro_batch_tokens == 8192
    assert t.forward_plan() == ForwardPlan(micro_batch_size=64, micro_batch_tokens=8192)
    t = TrainerConfig(
        micro_batch_size=4,
        forward_batch_size=16,
        micro_batch_tokens=2048,
        forward_batch_tokens=8192,
        pack_sequences=True,
    )
    assert t.forward_plan() == ForwardPlan(16, micro_batch_tokens=8192, packed=True)
    assert t.epoch_plan() == EpochPlan(
        epochs=1, mini_batches=1, micro_batch_size=4, micro_batch_tokens=2048, pack_sequences=True
    )
    off = TrainerConfig(micro_batch_tokens=None)
    assert off.forward_plan().micro_batch_tokens is None


def _write_jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo"])
def test_rlhf_train_by_tokens_takes_the_steps_it_takes_by_rows(tmp_path, kind):
    """`rlhf-train sft | rm | dpo` with [train] micro_batch_tokens (sequences, or whole pairs,
    sorted into micro-batches of 64 tokens, one to three to a micro-batch) give the losses,
    the metrics (means over pairs, however many a micro-batch holds) and the weights of
    micro-batches of rows."""
    from safetensors.torch import load_file

    from ferrule_config import load_config
    from ferrule_trainer import dpo, rm, sft

    schema, train = {
        "sft": (sft.SFTConfig, sft.train),
        "rm": (rm.RMConfig, rm.train),
        "dpo": (dpo.DPOConfig, dpo.train),
    }[kind]
    words = ["a", "bb cc", "ddd eee fff", "g h i j k l m", "nn oo pp qq rr ss tt uu"]
    rows = [
        {
            "prompt": words[i % 5] + f" {i} =",
            "response": words[(i * 3) % 5],
            "chosen": words[(i * 3) % 5],
            "rejected": words[(i * 2 + 1) % 5] + " x",
        }
        for i in range(16)
    ]
    data = _write_jsonl(tmp_path / "data.jsonl", rows)
    losses, weights = {}, {}
    for tokens in ("none", 64):
        out = tmp_path / str(tokens)
        path = tmp_path / f"{tokens}.toml"
        path.write_text(
            f'[model]\npath = "{tiny_model("qwen2")}"\ndtype = "float32"\nzero_stage = 0\n'
            f'[data]\npath = "{data}"\n'
            "[train]\nbatch_size = 8\nmicro_batch_size = 8\nlearning_rate = 1e-3\n"
            f'micro_batch_tokens = {json_value(tokens)}\n[output]\ndir = "{out}"\n'
        )
        lines = []
        train(load_config(path, schema), log=lines.append)
        losses[tokens] = [_step_figures(line) for line in lines if line.startswith("step ")]
        model = out / ("model" if kind == "sft" else f"{kind}/model")
        weights[tokens] = {}
        for file in sorted(model.glob("*.safetensors")):
            weights[tokens].update(load_file(file))
    assert len(losses[64]) == len(losses["none"]) == 2
    for ours, theirs in zip(losses[64], losses["none"], strict=True):  # loss, accuracy, margin...
        assert ours.keys() == theirs.keys() and "loss" in ours
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=2e-3, abs=1e-6), key
    assert weights[64].keys() == weights["none"].keys()
    for name, value in weights["none"].items():
        torch.testing.assert_close(weights[64][name], value, rtol=1e-4, atol=1e-5)


def _step_figures(line: str) -> dict[str, float]:
    """The figures of a "step 1/2 epoch 0 key value key value ... s 0.12" log line, less the
    timings."""
    words = line.split()[4:]
    figures = dict(zip(words[0::2], map(float, words[1::2]), strict=True))
    return {k: v for k, v in figures.items() if k not in ("s", "tokens/s")}


def json_value(value):
    return f'"{value}"' if isinstance(value, str) else str(value)
