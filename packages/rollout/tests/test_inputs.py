"""Checks that need no engine: sampling settings, the vLLM version gate, the CLI's bad paths."""

import subprocess
import sys

import pytest

from ferrule_rollout import BadRequestError, RolloutError, SamplingSettings
from ferrule_rollout import vllm_engine as engine_module


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": -1}, "n must be >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -3}, "top_k must be >= 1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_invalid_sampling_settings_name_the_field(fields, match):
    with pytest.raises(BadRequestError, match=match.replace("(", r"\(").replace("]", r"\]")):
        SamplingSettings(**fields)


def test_valid_sampling_settings():
    settings = SamplingSettings(n=4, temperature=0, top_k=-1, stop=["\n"], seed=3)
    assert settings.stop == ("\n",)


@pytest.mark.parametrize("installed", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_unsupported_vllm_names_installed_and_supported(installed, monkeypatch):
    monkeypatch.setattr(engine_module, "installed_vllm_version", lambda: installed)
    with pytest.raises(RolloutError) as caught:
        engine_module.VLLMEngine("/models/whatever")
    message = str(caught.value)
    assert f"vLLM {installed} is installed" in message and "vllm>=0.32,<0.33" in message


def test_supported_vllm_versions_pass():
    for version in ("0.32.0", "0.32.5", "0.32.0+cpu"):
        engine_module.check_vllm_version(version)
    with pytest.raises(RolloutError, match="not installed"):
        engine_module.check_vllm_version(None)


def test_missing_model_path_is_an_error_naming_it():
    with pytest.raises(RolloutError, match="model path '/no/such/model' does not exist"):
        engine_module.VLLMEngine("/no/such/model")


def test_cli_missing_model_exits_2_with_the_path():
    result = subprocess.run(
        [sys.executable, "-m", "ferrule_rollout", "serve", "--model", "/no/such/model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "model path '/no/such/model' does not exist" in result.stderr
