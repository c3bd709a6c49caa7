"""The package's own names: what another package imports to drive training, each imported on
first use so that `import ferrule_trainer` stays light."""

import subprocess
import sys

import pytest

import ferrule_trainer


def test_every_public_name_is_the_defining_modules_own():
    import importlib

    assert ferrule_trainer.__all__ == sorted(ferrule_trainer._HOMES)
    for name, home in ferrule_trainer._HOMES.items():
        module = importlib.import_module(f"ferrule_trainer.{home}")
        assert getattr(ferrule_trainer, name) is getattr(module, name), name
    assert set(ferrule_trainer.__all__) <= set(dir(ferrule_trainer))


def test_an_unknown_name_is_an_attribute_error_and_modules_still_import():
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        ferrule_trainer.Trainer  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'PPOConfig'"):
        from ferrule_trainer import PPOConfig  # noqa: F401
    from ferrule_trainer import memory, rl  # submodules, not names of the API

    assert memory.__name__ == "ferrule_trainer.memory" and rl.__name__ == "ferrule_trainer.rl"


def test_importing_the_settings_and_configs_does_not_import_torch():
    code = (
        "import sys\n"
        "from ferrule_trainer import EpochPlan, Group, PolicyLoss, TrainerConfig\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from ferrule_trainer import Batch\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
