"""The launcher composes everything, but `import ferrule_launcher` (and so `--help`) stays light,
and it uses the other packages through their public modules only."""

import ast
from pathlib import Path

import ferrule_launcher

# The modules of each package that other packages may import (their READMEs say so).
PUBLIC = {
    "ferrule_trainer": {
        "",
        "config",
        "batch",
        "memory",
        "rl",
        "groups",
        "settings",
        "step",
        "recipes",
        "actor",
        "critic",
        "sft",
        "chat",
        "jsonl",
    },
    "ferrule_rollout": {"", "config", "vllm_engine", "environments", "episodes", "exact"},
    "ferrule_rewards": {"", "client", "builtin", "server", "model"},
    "ferrule_weightsync": {""},
    "ferrule_config": {""},
}


def test_import_boundary(import_boundary):
    import_boundary("ferrule_launcher", not_on_import=["vllm", "deepspeed", "torch", "ray"])


def test_only_public_modules_of_the_other_packages():
    used = set()
    for path in Path(ferrule_launcher.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                package, _, module = name.partition(".")
                if package in PUBLIC:
                    used.add((path.name, package, module.split(".")[0]))
    private = {
        (file, f"{package}.{module}")
        for file, package, module in used
        if module not in PUBLIC[package] and not _is_attribute(package, module)
    }
    assert not private, f"the launcher imports internals of other packages: {sorted(private)}"


def _is_attribute(package: str, name: str) -> bool:
    """`from ferrule_trainer import rl` names a module; `from ferrule_rollout import Sample` names
    something the package's __init__ exports."""
    import importlib.util

    return importlib.util.find_spec(f"{package}.{name}") is None if name else True
