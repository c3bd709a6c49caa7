"""The `rlhf-launch` entry point is installed and fails clearly on what it cannot do yet."""

import shutil
import subprocess
from pathlib import Path

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny.toml"


def run(*args):
    exe = shutil.which("rlhf-launch")
    assert exe, "rlhf-launch is not on PATH: the [project.scripts] entry is missing"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


def test_help_lists_the_config_argument():
    result = run("--help")
    assert result.returncode == 0
    assert "config" in result.stdout


def test_missing_config_names_the_file(tmp_path):
    result = run(str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert "nope.toml does not exist" in result.stderr


def test_invalid_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    result = run(str(bad))
    assert result.returncode == 2
    assert "bad.toml is not valid TOML" in result.stderr


def test_default_example_reads_and_says_what_is_missing():
    result = run(str(EXAMPLE))
    assert result.returncode == 2
    assert "not implemented in this version yet" in result.stderr
