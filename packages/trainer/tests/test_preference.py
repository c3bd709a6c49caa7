"""Preference pairs (preference.py), and reward-model training and DPO on a synthetic preference
task of our own: the correct reversal of a word is preferred to another order of its letters."""

import json
from pathlib import Path

import pytest
import torch

from ferrule_testkit import reversal_pairs
from ferrule_trainer.cli import main
from ferrule_trainer.preference import Pair, PreferenceDataConfig, load_pairs, pair_batch
from ferrule_trainer.settings import EpochPlan, PreferenceLoss

# the tiny example's policy: the testkit's tiny Qwen2 after a short SFT on word reversal
WARM = Path(__file__).parents[3] / "examples" / "tiny" / "model"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_pairs_names_the_bad_line(tmp_path):
    data = PreferenceDataConfig(path=tmp_path / "p.jsonl", margin_key="m")
    for text, message in [
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n',
            r"p.jsonl:2: needs a string 'rejected'",
        ),
        ("{not json\n", r"p.jsonl:1: not JSON"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c", "m": "big"}\n', r"'m' must be a number"),
        ("\n", r"p.jsonl: no pairs"),
    ]:
        (tmp_path / "p.jsonl").write_text(text)
        with pytest.raises(ValueError, match=message):
            load_pairs(tmp_path / "p.jsonl", data)


def test_pair_batch_puts_chosen_first_and_masks_the_prompt():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WARM)
    pairs = [Pair("Reverse abc:", " cba", " abcabc", 0.5), Pair("Q:", " x", " y", 1.0)]
    batch = pair_batch(tokenizer, pairs, max_length=64, pad_id=tokenizer.pad_token_id)
    assert (batch.rows, batch.pairs) == (4, 2) and batch.margin.tolist() == [0.5, 1.0]
    first = tokenizer("Reverse abc: cba", add_special_tokens=False)["input_ids"]
    prompt = tokenizer("Reverse abc:", add_special_tokens=False)["input_ids"]
    assert batch.input_ids[0, : len(first)].tolist() == first
    assert batch.loss_mask[0].tolist()[: len(first)] == [0] * len(prompt) + [1] * (
        len(first) - len(prompt)
    )
    rejected = tokenizer("Reverse abc: abcabc", add_special_tokens=False)["input_ids"]
    assert batch.input_ids[2, : len(rejected)].tolist() == rejected  # rows 2-3: rejected


def test_cli_reports_bad_pairs_with_status_2(tmp_path, capsys):
    write(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b"}])
    config = tmp_path / "dpo.toml"
    config.write_text(f'[model]\npath = "{WARM}"\n[data]\npath = "pairs.jsonl"\n')
    assert main(["dpo", str(config)]) == 2
    assert "pairs.jsonl:1: needs a string 'rejected'" in capsys.readouterr().err
    (tmp_path / "rm.toml").write_text(
        f'[model]\npath = "{WARM}"\n[data]\npath = "p"\n[rm]\nlos = 1\n'
    )
    assert main(["rm", str(tmp_path / "rm.toml")]) == 2
    assert "[rm] los: unknown key" in capsys.readouterr().err
    config.write_text(
        f'[model]\npath = "{WARM}"\n[data]\npath = "pairs.jsonl"\n'
        "[dpo]\nloss = 'ipo'\nlabel_smoothing = 0.1\n"
    )
    assert main(["dpo", str(config)]) == 2
    assert "[dpo] label_smoothing: is conservative DPO's; IPO has none" in capsys.readouterr().err


def config_file(
    tmp_path: Path, kind: str, extra: str, pairs: int = 512, held_out: int = 100, model=WARM
) -> Path:
    train = write(tmp_path / "train.jsonl", reversal_pairs(pairs, seed=1))
    test = write(tmp_path / "test.jsonl", reversal_pairs(held_out, seed=2))
    path = tmp_path / f"{kind}.toml"
    path.write_text(
        f'[model]\npath = "{model}"\ndtype = "float32"\nzero_stage = 0\n'
        f'[data]\npath = "{train}"\neval_path = "{test}"\nmax_length = 32\n'
        f'[output]\ndir = "{tmp_path / kind}"\n' + extra
    )
    return path


def test_dpo_raises_the_margin_and_the_greedy_accuracy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ferrule_config import load_config
    from ferrule_trainer.dpo import DPOConfig, train

    path = config_file(
        tmp_path,
        "dpo",
        "[dpo]\nbeta = 0.1\n[train]\nepochs = 2\nbatch_size = 32\nmicro_batch_size = 16\n"
        "learning_rate = 5e-4\n[eval]\nevery = 8\n",
    )
    lines = []
    final = train(load_config(path, DPOConfig), log=lines.append)
    first_eval = next(line for line in lines if "eval/margin" in line)
    # the policy starts as the reference: every implicit reward, and so the margin, is 0
    assert final["eval/accuracy"] > 0.8 and final["eval/margin"] > 0.1, lines

    def greedy_accuracy(model_path) -> float:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        rows, hits = reversal_pairs(100, seed=2), 0
        for row in rows:
            ids = tokenizer(row["prompt"], return_tensors="pt", add_special_tokens=False)
            out = model.generate(**ids, max_new_tokens=6, do_sample=False)
            text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
            hits += text.strip() == row["chosen"].strip()
        return hits / len(rows)

    before, after = greedy_accuracy(WARM), greedy_accuracy(tmp_path / "dpo" / "model")
    print(f"dpo: greedy accuracy {before:.2f} -> {after:.2f}; held-out {final}")
    assert after > before + 0.1, (before, after, first_eval)


def test_a_critic_started_from_a_reward_model_takes_its_body_and_head(tmp_path):
    """[critic] init = "reward_model": the critic (a value per token) loads the reward model's
    folder; its head is the reward model's scalar head, not a new one."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from ferrule_trainer import engine

    torch.manual_seed(3)
    config = AutoConfig.from_pretrained(WARM, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(WARM, config=config)
    reward_model.save_pretrained(tmp_path / "rm")
    critic = engine.load_model(tmp_path / "rm", kind="value", dtype="float32")
    assert torch.equal(critic.score.weight, reward_model.score.weight)
    body = dict(reward_model.model.named_parameters())
    assert all(torch.equal(p, body[name]) for name, p in critic.model.named_parameters())


def test_preference_and_likelihood_steps_on_the_rl_layout():
    """The recipes' steps (rlhf-launch's rejection sampling and iterative DPO) on the RL batch
    layout: a policy equal to its reference starts at DPO loss log 2, and steps raise the
    margin; SFT on the chosen responses lowers their NLL."""
    import math
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from ferrule_trainer.actor import Actor
    from ferrule_trainer.batch import Batch
    from ferrule_trainer.rl import build_batch

    tokenizer = AutoTokenizer.from_pretrained(WARM)
    rows = []
    for pair in reversal_pairs(16, seed=5):  # chosen in even rows, rejected in odd ones
        prompt = tokenizer(pair["prompt"], add_special_tokens=False)["input_ids"]
        for response in (pair["chosen"], pair["rejected"]):
            ids = tokenizer(response, add_special_tokens=False)["input_ids"]
            rows.append(SimpleNamespace(prompt_token_ids=prompt, token_ids=ids))
    batch = build_batch(rows, tokenizer.pad_token_id)
    common = dict(dtype="float32", zero_stage=0, seed=0, temperature=0.7)
    reference = Actor(WARM, train=False, **common)
    batch = batch.replace(ref_logprobs=reference.logprobs(batch, temperature=1.0))
    policy = Actor(WARM, learning_rate=1e-3, **common)
    dpo = PreferenceLoss(beta=0.5)
    # micro-batches of 3 rows would split a pair: 6 rows, 3 pairs each
    first = policy.preference_epochs(batch, EpochPlan(micro_batch_size=6), dpo)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)  # h = 0 for every pair
    assert first["margin"] == pytest.approx(0.0, abs=1e-5)
    later = policy.preference_epochs(batch, EpochPlan(3, 2, micro_batch_size=8), dpo)
    assert later["margin"] > 0 and later["loss"] < math.log(2)

    chosen = Batch(batch.input_ids[0::2], batch.attention_mask[0::2], batch.response_mask[0::2])
    sft = Actor(WARM, learning_rate=1e-3, **common)
    losses = [
        sft.likelihood_epochs(chosen, EpochPlan(micro_batch_size=8))["loss"] for _ in range(4)
    ]
    assert losses[-1] < losses[0]


class Crash(Exception):
    pass


@pytest.mark.parametrize(
    "kind, zero_stage, lora_rank", [("rm", 2, 0), ("dpo", 3, 0), ("rm", 2, 4), ("dpo", 2, 4)]
)
def test_preference_training_resumes_exactly(tmp_path, kind, zero_stage, lora_rank):
    """Killed after step 5 (saved at step 4), `rlhf-train rm|dpo` resumes and ends where the
    uninterrupted run ends: the same losses from step 5 on, the same held-out figures, the same
    saved weights. Under ZeRO-2 and -3, with and without LoRA."""
    from ferrule_config import load_config
    from ferrule_trainer.dpo import DPOConfig
    from ferrule_trainer.dpo import train as train_dpo
    from ferrule_trainer.rm import RMConfig
    from ferrule_trainer.rm import train as train_rm

    schema, train = {"rm": (RMConfig, train_rm), "dpo": (DPOConfig, train_dpo)}[kind]

    def config(out: str):
        path = config_file(
            tmp_path / out,
            kind,
            "[train]\nepochs = 2\nbatch_size = 16\nmicro_batch_size = 8\nlearning_rate = 1e-3\n"
            "warmup_steps = 1\n",
            pairs=64,
        )
        text = path.read_text().replace("zero_stage = 0", f"zero_stage = {zero_stage}")
        text = text.replace("[output]\n", "[output]\nsave_every = 2\n")
        path.write_text(text.replace("[model]\n", f"[model]\nlora_rank = {lora_rank}\n"))
        return load_config(path, schema)

    def losses(lines: list[str]) -> list[str]:  # "step 5/8 ... loss 0.69 ..." less the timing
        return [line.rsplit(" s ", 1)[0] for line in lines if line.startswith("step ")]

    (tmp_path / "full").mkdir()
    (tmp_path / "crashed").mkdir()
    full_log: list[str] = []
    full = train(config("full"), log=full_log.append)
    assert len(losses(full_log)) == 8  # 64 pairs / 16 per step x 2 epochs

    def crash_at_step_5(line: str) -> None:
        if line.startswith("step 5/"):
            raise Crash  # killed after step 5 ran, before it was saved

    with pytest.raises(Crash):
        train(config("crashed"), log=crash_at_step_5)
    resumed_log: list[str] = []
    resumed = train(config("crashed"), log=resumed_log.append)
    assert any("resumed from" in line and "at step 4" in line for line in resumed_log)
    assert losses(resumed_log) == losses(full_log)[4:]
    assert resumed == full  # the held-out accuracy, margin, moments, to the last bit
    saved = [tmp_path / out / kind / "model" for out in ("full", "crashed")]
    if lora_rank:
        assert all((path / "adapter" / "adapter_config.json").exists() for path in saved)
    weights = [_weights(path) for path in saved]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update({f"{file.name}:{k}": v for k, v in load_file(file).items()})
    assert found, f"no weights in {folder}"
    return found
