"""The `rlhf-launch` entry point: help, errors before anything starts, dry run."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny.toml"
# what Qwen2.5-1.5B's config.json says of its shape (the memory plan reads it)
QWEN25_1_5B_CONFIG = dict(model_type="qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)


def run(*args):
    exe = shutil.which("rlhf-launch")
    assert exe, "rlhf-launch is not on PATH: the [project.scripts] entry is missing"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_options():
    result = run("--help")
    assert result.returncode == 0
    for word in ("config", "--dry-run", "--resume", "--set", "ray job submit"):
        assert word in result.stdout


def test_help_lists_every_table():
    from ferrule_launcher.config import Config

    help_text = " ".join(run("--help").stdout.split())  # argparse wraps the epilog
    for table in Config.model_fields:
        assert f"[{table}]" in help_text


def test_missing_config_names_the_file(tmp_path):
    result = run(str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert "nope.toml: config file does not exist" in result.stderr


def test_invalid_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    result = run(str(bad))
    assert result.returncode == 2
    assert "bad.toml: not valid TOML" in result.stderr


def test_bad_key_stops_before_anything_starts(tmp_path):
    result = run(str(EXAMPLE), "--set", "rollout.temperature=-1", "--set", "loop.stepz=3")
    assert result.returncode == 2
    assert "tiny.toml: [rollout] temperature: Input should be greater than 0" in result.stderr
    assert "tiny.toml: [loop] stepz: unknown key" in result.stderr
    assert "ray" not in result.stdout.lower()


def test_dry_run_prints_the_resolved_config():
    result = run(str(EXAMPLE), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "[trainer]" in result.stdout and 'estimator = "grpo"' in result.stdout
    assert str(EXAMPLE.parent / "tiny" / "model") in result.stdout  # resolved near the file


@pytest.mark.e2e  # several rlhf-launch processes, 15-20 s
def test_gpu_example_passes_the_dry_run_once_its_local_paths_exist(tmp_path):
    """examples/grpo-gsm8k-gpu.toml names a model and data the user brings: with those paths
    pointing at files that exist, the whole configuration is valid as written."""
    gpu_example = EXAMPLE.parent / "grpo-gsm8k-gpu.toml"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(QWEN25_1_5B_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the data's lengths need one
        shutil.copy(EXAMPLE.parent / "tiny" / "model" / name, tmp_path / "model" / name)
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    paths = (
        "--set",
        f'model.path="{tmp_path / "model"}"',
        "--set",
        f'task.sources=[{{path="{tmp_path / "train.jsonl"}", eval_path="{tmp_path / "test.jsonl"}"}}]',
    )
    if shutil.which("nvidia-smi") is None:
        # on a laptop the dry run checks everything else; the memory plan's keys stay "auto"
        # and it says how to plan for a GPU size (a run itself is refused: see test_plan.py)
        unsized = run(str(gpu_example), "--dry-run", *paths)
        assert unsized.returncode == 0, unsized.stderr
        assert 'zero_stage = "auto"' in unsized.stdout
        assert 'gradient_checkpointing = "auto"' in unsized.stdout
        assert "this machine shows no GPU" in unsized.stdout
        assert "--plan --set ray.gpu_memory_gb=80" in unsized.stdout
    result = run(str(gpu_example), "--dry-run", *paths, "--set", "ray.gpu_memory_gb=80")
    assert result.returncode == 0, result.stderr
    assert "configuration is valid" in result.stdout
    for line in ("ranks = 8", "engines = 8", 'placement = "colocate_all"', "gpus_per_role = 1.0"):
        assert line in result.stdout
    # on 80 GB GPUs the memory plan keeps everything on them (the example names no memory key)
    for line in ("offload_between_phases = false", "offload_optimizer = false", "zero_stage = 2"):
        assert line in result.stdout
    # as shipped, without the user's files, it says what is missing
    missing = run(str(gpu_example), "--dry-run")
    assert missing.returncode == 2 and "[model] path: no Hugging Face model at" in missing.stderr


@pytest.mark.e2e  # several rlhf-launch processes, 15-20 s
def test_bad_data_stops_before_anything_starts_naming_the_file_and_row(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1 + 1 ="}\n{"question": "2 + 2 ="}\n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "3 + 3 ="}\n')
    data = f'[{{path="{tmp_path / "train.jsonl"}", eval_path="{tmp_path / "test.jsonl"}"}}]'
    result = run(str(EXAMPLE), "--set", 'task.name="data"', "--set", f"task.sources={data}")
    assert result.returncode == 2
    assert (
        f"{tmp_path / 'train.jsonl'}: row 2: needs a non-empty string or chat messages 'prompt'"
        in (result.stderr)
    )
    assert "ray" not in result.stdout.lower()  # nothing started
    good = f'[{{path="{tmp_path / "test.jsonl"}", eval_path="{tmp_path / "test.jsonl"}"}}]'
    dry = run(
        str(EXAMPLE), "--dry-run", "--set", 'task.name="data"', "--set", f"task.sources={good}"
    )
    assert dry.returncode == 0, dry.stderr
    assert "# prompts: test: 1 training / 1 held-out prompts, weight 1" in dry.stdout
