"""Workspace-wide pytest setup: GPU tests skip where there is no GPU; the import-boundary check.

This file sits at the repository root, so it applies both to `uv run pytest` and to each
package's isolated run (`uv run --isolated --package ferrule-<name> pytest packages/<name>`).
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Read when ray is first imported. Under `uv run`, Ray starts each worker through `uv run` again
# (13-74 s an actor on the 2-core CI machine, against ~1 s): the tests that call ray.init in
# their own process share this interpreter instead, as rlhf-launch's run() does.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:  # torch is imported only when a GPU test was collected
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    for item in gpu_items:
        needed = item.get_closest_marker("gpu").kwargs.get("count", 1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {gpus}"))


def modules_loaded_by_import(package: str) -> set[str]:
    """Top-level module names present after `import package` in a fresh interpreter."""
    code = f"import json, sys; import {package}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in json.loads(out.stdout)}


def imports_in_source(package: str) -> dict[str, set[str]]:
    """Every top-level module that the package's source files import, with the files that do."""
    spec = importlib.util.find_spec(package)
    found: dict[str, set[str]] = {}
    for root in spec.submodule_search_locations:
        for path in Path(root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(path.name)
    return found


def undeclared_imports(package: str, imported: dict[str, set[str]]) -> dict[str, list[str]]:
    """Third-party modules the source imports that no declared requirement of its distribution
    provides (a sibling or a library that is only installed by chance)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, requires
    from importlib.metadata import distribution as find_distribution

    from packaging.requirements import Requirement

    distribution = find_distribution(package.replace("_", "-"))
    declared = {
        Requirement(line).name.lower().replace("_", "-")
        for line in requires(distribution.name) or []
    }
    providers = packages_distributions()
    missing = {}
    for name, files in imported.items():
        if name in sys.stdlib_module_names or name in (package, "__future__"):
            continue
        dists = {d.lower().replace("_", "-") for d in providers.get(name, [])}
        if not dists:  # editable installs (our workspace members) list no top-level modules
            try:
                dists = {find_distribution(name.replace("_", "-")).name.lower()}
            except PackageNotFoundError:
                dists = set()
        if not dists & declared:
            missing[name] = sorted(files)
    return missing


def check_import_boundary(package, *, never=(), not_on_import=()):
    """Assert DESIGN.md's import rules for `package`.

    never:          modules the package's source must not import anywhere (checked statically,
                    so a lazy import inside a function is caught too).
    not_on_import:  modules that `import package` must not load (keeps the import cheap).
    Every third-party module the source imports must come from a declared requirement.
    """
    imported = imports_in_source(package)
    broken = {name: sorted(files) for name, files in imported.items() if name in never}
    assert not broken, f"{package} imports modules it must never import: {broken}"
    missing = undeclared_imports(package, imported)
    assert not missing, f"{package} imports modules from undeclared distributions: {missing}"
    loaded = modules_loaded_by_import(package) & (set(never) | set(not_on_import))
    assert not loaded, f"`import {package}` loads {sorted(loaded)}"


@pytest.fixture
def import_boundary():
    return check_import_boundary
