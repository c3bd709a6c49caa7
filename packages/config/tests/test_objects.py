"""load_object: `module:name` from the current directory, `file.py:name`, dotted names, and one
line naming the spec for each way a spec can fail."""

import ast
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import ferrule_config.objects
from ferrule_config.objects import load_object

OBJECTS = """
import dataclasses
import sys

first_on_path = sys.path[0]  # where modules were looked up while this one was imported


@dataclasses.dataclass
class Point:
    x: int = 0

    class Inner:
        value = 7
"""


@pytest.fixture
def forget():
    """forget(name): the module is removed from sys.modules after the test."""
    names = []
    yield names.append
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def bare_path(monkeypatch, tmp_path):
    """The current directory is tmp_path, and neither it nor '' is on sys.path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])


def test_a_module_in_the_current_directory_is_first_on_the_path_while_it_imports(
    tmp_path, bare_path, forget
):
    (tmp_path / "objects_in_cwd.py").write_text(OBJECTS)
    forget("objects_in_cwd")
    assert load_object("objects_in_cwd:Point", "thing").__name__ == "Point"
    assert sys.modules["objects_in_cwd"].first_on_path == str(tmp_path)


def test_the_current_directory_goes_last_after_the_import(tmp_path, bare_path, forget):
    """First on sys.path for good, a `json.py` beside the user's module would shadow the json
    that anything imports later in the process."""
    (tmp_path / "objects_last.py").write_text(OBJECTS)
    forget("objects_last")
    load_object("objects_last:Point", "thing")
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1


def test_the_current_directory_goes_last_when_the_import_fails(tmp_path, bare_path):
    (tmp_path / "objects_broken_in_cwd.py").write_text("1 / 0\n")
    with pytest.raises(ValueError, match="ZeroDivisionError"):
        load_object("objects_broken_in_cwd:f", "thing")
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1
    assert "objects_broken_in_cwd" not in sys.modules


def test_a_path_already_there_is_left_as_it_was(tmp_path, monkeypatch, forget):
    (tmp_path / "objects_on_path.py").write_text(OBJECTS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    before = list(sys.path)
    forget("objects_on_path")
    load_object("objects_on_path:Point", "thing")
    assert sys.path == before


def test_a_file_is_a_module_named_after_its_stem(tmp_path, forget):
    (tmp_path / "objects_file.py").write_text(OBJECTS)
    forget("objects_file")
    point = load_object(f"{tmp_path}/objects_file.py:Point", "thing")
    assert sys.modules["objects_file"].Point is point
    # pickling finds the class by its module's name in sys.modules
    assert pickle.loads(pickle.dumps(point(3))) == point(3)


def test_a_relative_file_is_taken_from_the_current_directory(tmp_path, monkeypatch, forget):
    (tmp_path / "objects_relative.py").write_text(OBJECTS)
    monkeypatch.chdir(tmp_path)
    forget("objects_relative")
    assert load_object("objects_relative.py:Point", "thing").__name__ == "Point"


def test_dotted_names_are_followed(tmp_path, forget):
    (tmp_path / "objects_dotted.py").write_text(OBJECTS)
    forget("objects_dotted")
    assert load_object(f"{tmp_path}/objects_dotted.py:Point.Inner.value", "thing") == 7
    assert load_object("json:JSONDecoder.decode", "thing") is json.JSONDecoder.decode


def test_a_broken_file_leaves_no_module_behind(tmp_path):
    (tmp_path / "objects_broken.py").write_text("import sys\n1 / 0\n")
    spec = f"{tmp_path}/objects_broken.py:f"
    with pytest.raises(ValueError) as error:
        load_object(spec, "thing")
    assert str(error.value) == (
        f"thing {spec!r}: importing it raised {tmp_path / 'objects_broken.py'}:2: "
        "ZeroDivisionError: division by zero"
    )
    assert "objects_broken" not in sys.modules


def error_of(spec, **options) -> str:
    with pytest.raises(ValueError) as error:
        load_object(spec, "thing", **options)
    assert error.value.__cause__ is None and error.value.__suppress_context__
    return str(error.value)


@pytest.mark.parametrize("spec", ["no_colon", ":name", "module:", None])
def test_a_spec_without_both_parts_names_the_forms(spec):
    expected = "expected 'module:attribute' or 'path/to/file.py:attribute'"
    assert error_of(spec) == f"thing {spec!r}: {expected}"
    assert error_of(spec, attribute="Class").endswith(
        "expected 'module:Class' or 'path/to/file.py:Class'"
    )


def test_a_missing_file(tmp_path):
    spec = f"{tmp_path}/nowhere.py:f"
    assert error_of(spec) == f"thing {spec!r}: no file {tmp_path / 'nowhere.py'}"


@pytest.mark.parametrize("module", ["objects_no_such_module", "json.no_such_module"])
def test_a_missing_module(module):
    assert error_of(f"{module}:f") == (
        f"thing '{module}:f': cannot import {module!r}: No module named {module!r}"
    )


def test_a_missing_attribute():
    assert (
        error_of("json:JSONDecoder.nope")
        == "thing 'json:JSONDecoder.nope': json has no 'JSONDecoder.nope'"
    )


@pytest.mark.parametrize("form", ["module", "file"])
@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(:\n", "{file}:1: SyntaxError: invalid syntax"),
        ("x = 1\n1 / 0\n", "importing it raised {file}:2: ZeroDivisionError: division by zero"),
        # a dependency of the module missing is not the module missing
        (
            "import objects_no_such_dependency\n",
            "importing it raised {file}:1: ModuleNotFoundError: "
            "No module named 'objects_no_such_dependency'",
        ),
    ],
)
def test_a_module_that_raises_is_one_line_with_the_file_and_line(
    tmp_path, bare_path, form, source, message
):
    path = tmp_path / "objects_raises.py"
    path.write_text(source)
    spec = "objects_raises:f" if form == "module" else f"{path}:f"
    assert error_of(spec) == f"thing {spec!r}: " + message.format(file=path)
    assert "objects_raises" not in sys.modules


def test_the_standard_library_only():
    """The reward server imports this module: no pydantic (the tables) comes with it."""
    imported = top_level_imports(Path(ferrule_config.objects.__file__))
    assert imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
    code = (
        "import sys, ferrule_config.objects\n"
        "print(sorted(m for m in sys.modules if m.startswith(('pydantic', 'ferrule_config'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['ferrule_config', 'ferrule_config.objects']"


def top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")  # a relative import counts as not the standard library
    return {name.split(".")[0] for name in names}
