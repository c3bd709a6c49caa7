"""Load a user's Python object named `module:attribute` or `path/to/file.py:attribute`.

    score = load_object("my_rewards.py:score", "reward function")
    environment = load_object("package.module:Guess", "environment", attribute="Class")

Reward functions (ferrule-rewards) and environments (ferrule-rollout) are named this way. This
module uses only the standard library: the reward server imports it without pydantic, and
ferrule_config/__init__.py imports the tables lazily for the same reason.
"""

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType


class _Refused(Exception):
    """Why a spec names no object. load_object puts `what` and the spec in front of it."""


def load_object(spec: str, what: str, *, attribute: str = "attribute") -> object:
    """Return the object that `spec` names: `module:name` or `path/to/file.py:name`. The module
    is looked up from the current directory first, as `python -m` would. The name may be dotted
    (`module:Class.method`). Any other spec raises ValueError, one line starting
    `{what} {spec!r}: `. `attribute` is the word for the name in the expected forms
    ("function", "Class")."""
    try:
        module_name, name = _split(spec, attribute)
        if module_name.endswith(".py"):
            module = _import_file(module_name)
        else:
            module = _import_module(module_name)
        return _walk(module, module_name, name)
    except _Refused as refused:
        raise ValueError(f"{what} {spec!r}: {refused}") from None


def _split(spec: str, attribute: str) -> tuple[str, str]:
    """(module or file, attribute), split at the last ':' (a Windows drive has one too)."""
    module_name, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not name:
        raise _Refused(f"expected 'module:{attribute}' or 'path/to/file.py:{attribute}'")
    return module_name, name


def _import_file(file_name: str) -> ModuleType:
    """Run the file as a module named after its stem."""
    path = Path(file_name).resolve()
    if not path.is_file():
        raise _Refused(f"no file {path}")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    # Register the module before it runs: pickling (for a scoring or tool process) and
    # dataclasses look the module up by name in sys.modules.
    sys.modules[path.stem] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(path.stem, None)  # it ran only partly: the next attempt starts afresh
        raise _Refused(_import_failure(error)) from None
    return module


def _import_module(module_name: str) -> ModuleType:
    """The module, with the current directory first on sys.path while it is imported."""
    cwd = str(Path.cwd())
    added = "" not in sys.path and cwd not in sys.path
    if added:  # first while the user's module is imported, as `python -m` would
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if not _names_the_module(error, module_name):  # it imports something that is missing
            raise _Refused(_import_failure(error)) from None
        raise _Refused(f"cannot import {module_name!r}: {error}") from None
    except Exception as error:  # the module exists but raised: the user must fix it
        raise _Refused(_import_failure(error)) from None
    finally:
        if added and cwd in sys.path:
            # Move it last: a `json.py` there must not shadow the json imported later.
            sys.path.remove(cwd)
            sys.path.append(cwd)


def _names_the_module(error: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the missing module is `module_name` or a package above it."""
    return error.name is not None and f"{module_name}.".startswith(f"{error.name}.")


def _walk(module: ModuleType, module_name: str, name: str) -> object:
    """The attribute `name` of the module, dotted names followed one part at a time."""
    target = module
    for part in name.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise _Refused(f"{module_name} has no {name!r}") from None
    return target


def _import_failure(error: Exception) -> str:
    """One line on why a module failed to import, with the file and line to fix (a traceback
    through importlib says no more than that, and often ends up in another process's log)."""
    if isinstance(error, SyntaxError):
        return f"{error.filename}:{error.lineno}: {type(error).__name__}: {error.msg}"
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"importing it raised {where}{type(error).__name__}: {error}"
