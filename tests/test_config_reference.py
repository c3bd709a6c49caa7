"""docs/config.md is what scripts/config_reference.py writes from the config models today, and
docs/quickstart-gpu.md's sizing table what scripts/sizing_table.py computes."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def check(script: str) -> None:
    """`scripts/<script> --check` passes: the docs hold what it writes today."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_config_reference_is_current():
    check("config_reference.py")


def test_config_reference_has_every_key():
    from ferrule_launcher.config import Config

    text = (ROOT / "docs" / "config.md").read_text()
    assert "### `[environment]`" in text and "### `[[task.sources]]`" in text
    for name, field in Config.model_fields.items():
        model = next(
            a
            for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
            if hasattr(a, "model_fields")
        )
        for key in model.model_fields:
            assert f"| `{key}` |" in text, f"[{name}] {key} is missing"


def test_the_sizing_table_in_the_gpu_quickstart_is_what_the_plan_computes_today():
    check("sizing_table.py")
