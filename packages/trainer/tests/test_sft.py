"""SFT: data handling, the CLI's config errors, and a run that resumes exactly after a crash."""

import json

import pytest
import torch

from ferrule_testkit import tiny_model
from ferrule_trainer.cli import main
from ferrule_trainer.sft import SFTConfig, collate, load_examples, tokenize


def _data(tmp_path, n=24):
    path = tmp_path / "train.jsonl"
    lines = [json.dumps({"prompt": f"{i}+{i}=", "response": str(2 * i)}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_examples_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: needs a string 'response'"):
        load_examples(path, "prompt", "response")


def test_tokenize_masks_the_prompt_and_collate_pads():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    ids, mask = tokenize(tokenizer, "12+30=", "42", max_length=64)
    prompt_len = len(tokenizer("12+30=", add_special_tokens=False)["input_ids"])
    assert ids[-1] == tokenizer.eos_token_id
    assert mask == [0] * prompt_len + [1] * (len(ids) - prompt_len)
    batch = collate([(ids, mask), (ids[:3], mask[:3])], pad_id=tokenizer.pad_token_id)
    assert batch.input_ids.shape == (2, len(ids)) and batch.margin is None
    assert batch.input_ids[1, 3:].tolist() == [tokenizer.pad_token_id] * (len(ids) - 3)
    assert batch.attention_mask[1].tolist() == [1, 1, 1] + [0] * (len(ids) - 3)
    assert batch.loss_mask[0].tolist() == mask and batch.loss_mask[1].sum() == 0


def test_cli_reports_config_errors(tmp_path, capsys):
    config = tmp_path / "sft.toml"
    config.write_text('[model]\npath = "m"\n[data]\npath = "d"\n[trian]\n')
    assert main(["sft", str(config)]) == 2
    assert "sft.toml: table [trian]: unknown table (known: data, model, output, train)" in (
        capsys.readouterr().err
    )


class Crash(Exception):
    pass


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_resume_continues_exactly(tmp_path, zero_stage):
    from ferrule_config import load_config
    from ferrule_trainer.sft import train

    data = _data(tmp_path)
    model = tiny_model("qwen2")

    def config(out):
        path = tmp_path / f"{out}.toml"
        path.write_text(
            f'[model]\npath = "{model}"\ndtype = "float32"\nzero_stage = {zero_stage}\n'
            f'[data]\npath = "{data}"\n'
            "[train]\nepochs = 2\nbatch_size = 8\nmicro_batch_size = 4\nlearning_rate = 1e-3\n"
            f'warmup_steps = 1\n[output]\ndir = "{tmp_path / out}"\nsave_every = 2\n'
        )
        return load_config(path, SFTConfig)

    uninterrupted = train(config("full"), log=lambda line: None)
    assert len(uninterrupted) == 6  # 24 examples / 8 per step x 2 epochs
    assert uninterrupted[-1] < uninterrupted[0]

    def crash_at_step_5(line):
        if line.startswith("step 5/"):
            raise Crash  # killed after step 5 ran, before it was saved

    with pytest.raises(Crash):
        train(config("crashed"), log=crash_at_step_5)
    resumed = train(config("crashed"), log=lambda line: None)  # from the state of step 4
    assert resumed == uninterrupted[4:]  # bit for bit: weights, Adam, schedule, data position

    from transformers import AutoModelForCausalLM

    for out in ("full", "crashed"):  # the final models are Hugging Face checkpoints
        params = dict(
            AutoModelForCausalLM.from_pretrained(tmp_path / out / "model").named_parameters()
        )
        if out == "full":
            first = params
    assert all(torch.equal(first[name], params[name]) for name in first)
