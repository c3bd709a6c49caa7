"""Run by .ci/run inside the clean venv: our installed wheels import, and every requirement they
declare (sibling ranges included) is met by what is installed there."""

import importlib
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.requirements import Requirement

PACKAGES = {  # distribution -> the extras .ci/run relies on
    "ferrule-weightsync": [],
    "ferrule-grpc-auth": [],
    "ferrule-rewards": ["model"],
    "ferrule-rollout": ["cpu"],
    "ferrule-trainer": [],
    "ferrule-launcher": ["cpu", "wandb"],
}
problems = []
for name, extras in PACKAGES.items():
    module = importlib.import_module(name.replace("-", "_"))
    assert "/venv/" in module.__file__, f"{name} imported from {module.__file__}, not the wheel"
    for line in distribution(name).requires or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker and not any(marker.evaluate({"extra": extra}) for extra in ["", *extras]):
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            problems.append(f"{name} requires {requirement}, which is not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{name} requires {requirement}, but {installed} is installed")
    print(f"{name} {module.__version__}: imports from the venv, requirements checked")
if problems:
    raise SystemExit("wheel check failed:\n  " + "\n  ".join(problems))
