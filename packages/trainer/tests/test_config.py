"""TOML configs: errors name the file, the table and the key before anything starts."""

from pathlib import Path

import pytest

from ferrule_config import ConfigError, load_config
from ferrule_trainer.sft import SFTConfig


def _write(tmp_path, text):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    path = tmp_path / "sft.toml"
    path.write_text(text)
    return path


def test_sft_config_loads_with_defaults(tmp_path):
    path = _write(
        tmp_path, '[model]\npath = "m"\n[data]\npath = "d.jsonl"\n[train]\nlearning_rate = 1\n'
    )
    config = load_config(path, SFTConfig)
    assert config.model.path == tmp_path / "m" and config.model.zero_stage == 2  # near the file
    assert config.train.learning_rate == 1.0 and isinstance(config.train.learning_rate, float)
    assert config.output.dir == Path("out/sft")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[model]\npath = "m"\n[data]\npath = "d"\n[train]\nlr = 1e-5\n',
            r"sft.toml: \[train\] lr: unknown key \(known: batch_size, epochs",
        ),
        ('[model]\npath = "m"\n', r"sft.toml: table \[data\]: is required"),
        ('[model]\n[data]\npath = "d"\n', r"sft.toml: \[model\] path: is required"),
        ('[model]\npath = "nowhere"\n[data]\npath = "d"\n', r"\[model\] path: no Hugging Face"),
        (
            '[model]\npath = "m"\n[data]\npath = "d"\n[train]\nepochs = "two"\n',
            r"\[train\] epochs: Input should be a valid integer.*, got 'two'",
        ),
        (
            '[model]\npath = "m"\ndtype = "fp16"\n[data]\npath = "d"\n',
            r"\[model\] dtype: Input should be 'float32' or 'bfloat16', got 'fp16'",
        ),
        (
            '[model]\npath = "m"\n[data]\npath = "d"\n[train]\nbatch_size = 0\n',
            r"\[train\] batch_size: Input should be greater than or equal to 1, got 0",
        ),
        ("[model\n", r"sft.toml: not valid TOML"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text), SFTConfig)


def test_trainer_table_builds_each_verbs_settings():
    from ferrule_trainer.config import TrainerConfig
    from ferrule_trainer.settings import Correction, EpochPlan, ForwardPlan, PolicyLoss

    table = TrainerConfig(
        estimator="gae", kl_coef=0.05, kl_in="reward", kl_kind="k1", epochs=2, gamma=0.9
    )
    assert table.policy_loss().kl_coef == 0.0  # the KL is in the reward, not the loss
    assert table.policy_loss(0.2).kl_coef == 0.0
    assert table.epoch_plan() == EpochPlan(
        epochs=2, mini_batches=1, micro_batch_size=64, micro_batch_tokens=8192
    )
    assert table.forward_plan() == ForwardPlan(64, 8192, packed=False)
    assert table.correction() == Correction()
    in_loss = TrainerConfig(kl_coef=0.05, clip_high=0.3, entropy_coef=0.01, dual_clip=None)
    assert in_loss.policy_loss() == PolicyLoss(
        clip_high=0.3, kl_coef=0.05, entropy_coef=0.01, dual_clip=None
    )
    assert in_loss.policy_loss(0.01).kl_coef == 0.01  # the adaptive controller's coefficient
    tis = TrainerConfig(rollout_correction="tis", tis_floor=0.1, sequence_mask=(0.5, 2.0))
    assert tis.correction() == Correction("tis", tis_floor=0.1, sequence_mask=(0.5, 2.0))


@pytest.mark.parametrize(("old", "new"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_renamed_dtype_says_the_new_name(tmp_path, old, new):
    path = _write(tmp_path, f'[model]\npath = "m"\ndtype = "{old}"\n[data]\npath = "d"\n')
    with pytest.raises(
        ConfigError, match=f"sft.toml: \\[model\\] dtype: '{old}' was renamed: use '{new}'"
    ):
        load_config(path, SFTConfig)
