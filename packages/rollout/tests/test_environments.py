"""load_environment: `module:Class` and `file.py:Class`, and errors that name the spec."""

import pytest

from ferrule_rollout.environments import (
    EnvironmentLoadError,
    EpisodeBudget,
    StepResult,
    check_step_result,
    load_environment,
)
from ferrule_rollout.tools import ToolEnvironment

ENV_FILE = """
from ferrule_rollout.environments import Environment, StepResult

class Echo(Environment):
    def reset(self, prompt, label, metadata):
        return prompt

    def step(self, model_output):
        return StepResult(None, 1.0)

class NotOne:
    pass

not_a_class = 3
"""


def test_load_from_a_module_and_a_file(tmp_path, monkeypatch):
    assert load_environment("ferrule_rollout.tools:ToolEnvironment") is ToolEnvironment
    (tmp_path / "my_envs.py").write_text(ENV_FILE)
    echo = load_environment(f"{tmp_path}/my_envs.py:Echo")
    assert echo.__name__ == "Echo" and echo().step("x") == StepResult(None, 1.0)
    monkeypatch.chdir(tmp_path)  # modules are looked up from the current directory first
    assert load_environment("my_envs.py:Echo").__name__ == "Echo"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'module:Class' or 'path/to/file.py:Class'"),
        ("missing.py:Echo", "no file .*missing.py"),
        ("no_such_module_xyz:Echo", "cannot import 'no_such_module_xyz'"),
        ("{dir}/my_envs.py:Missing", "has no 'Missing'"),
        ("{dir}/my_envs.py:NotOne", "is type .*not a subclass of .*Environment"),
        ("{dir}/my_envs.py:not_a_class", "is int 3, not a subclass"),
        ("{dir}/broken.py:Echo", "importing it raised .*broken.py:1: ZeroDivisionError"),
    ],
)
def test_load_errors_name_the_spec(tmp_path, spec, message):
    (tmp_path / "my_envs.py").write_text(ENV_FILE)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    spec = spec.format(dir=tmp_path)
    with pytest.raises(EnvironmentLoadError, match=message) as error:
        load_environment(spec)
    assert repr(spec) in str(error.value)


def test_step_results_are_checked():
    assert check_step_result(("next", 1, {"a": 1})) == StepResult("next", 1.0, {"a": 1})
    for bad, message in [
        ("text", "must return a StepResult"),
        ((5, 0.0, {}), "an observation must be text"),
        (([{"role": "user"}], 0.0, {}), "an observation must be text"),
        ((None, float("nan"), {}), "finite number"),
        ((None, "1", {}), "finite number"),
        ((None, 1.0, []), "info must be a dict"),
    ]:
        with pytest.raises(TypeError, match=message):
            check_step_result(bad)
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        EpisodeBudget(max_turns=0)


def test_the_current_directory_goes_last_once_the_module_is_imported(tmp_path, monkeypatch):
    """A module name is looked up in the current directory first, as `python -m` would; it
    stayed first on sys.path afterwards, so a `csv.py` beside the user's environment shadowed
    the csv module whatever imported it later in the process."""
    import sys

    (tmp_path / "cwd_envs.py").write_text(ENV_FILE)
    (tmp_path / "csv.py").write_text("raise RuntimeError('the shadowing csv.py ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "csv", raising=False)
    assert load_environment("cwd_envs:Echo").__name__ == "Echo"
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1
    import csv  # noqa: F401  the standard library's, not the one in the current directory
