"""TOML configs: errors name the file, the table and the key before anything starts."""

import pytest

from ferrule_trainer.config import ConfigError, load_config
from ferrule_trainer.sft import SFTConfig


def _write(tmp_path, text):
    path = tmp_path / "sft.toml"
    path.write_text(text)
    return path


def test_sft_config_loads_with_defaults(tmp_path):
    path = _write(
        tmp_path, '[model]\npath = "m"\n[data]\npath = "d.jsonl"\n[train]\nlearning_rate = 1\n'
    )
    config = load_config(path, SFTConfig)
    assert config.model.path == "m" and config.model.zero_stage == 2
    assert config.train.learning_rate == 1.0 and isinstance(config.train.learning_rate, float)
    assert config.output.dir == "out/sft"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[model]\npath = "m"\n[data]\npath = "d"\n[train]\nlr = 1e-5\n',
            r"sft.toml: \[train\] has unknown key\(s\) \['lr'\]",
        ),
        ('[model]\npath = "m"\n', r"sft.toml: table \[data\] is required"),
        ('[model]\n[data]\npath = "d"\n', r"sft.toml: \[model\] path is required"),
        (
            '[model]\npath = "m"\n[data]\npath = "d"\n[train]\nepochs = "two"\n',
            r"\[train\] epochs must be int, got 'two'",
        ),
        (
            '[model]\npath = "m"\ndtype = "fp16"\n[data]\npath = "d"\n',
            r"\[model\] dtype must be one of",
        ),
        (
            '[model]\npath = "m"\n[data]\npath = "d"\n[train]\nbatch_size = 0\n',
            r"\[train\] batch_size must be >= 1",
        ),
        ("[model\n", r"sft.toml: not valid TOML"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text), SFTConfig)
