"""The `rlhf-launch` entry point: help, errors before anything starts, dry run."""

import shutil
import subprocess
from pathlib import Path

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny.toml"


def run(*args):
    exe = shutil.which("rlhf-launch")
    assert exe, "rlhf-launch is not on PATH: the [project.scripts] entry is missing"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_options():
    result = run("--help")
    assert result.returncode == 0
    for word in ("config", "--dry-run", "--resume", "--set", "ray job submit"):
        assert word in result.stdout


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
