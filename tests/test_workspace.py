"""The workspace's shape: seven published members plus the dev kit, each complete and consistent."""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parents[1]
PUBLISHED = ["config", "weightsync", "grpc-auth", "rewards", "rollout", "trainer", "launcher"]
MEMBERS = {
    path.parent.name: tomllib.loads(path.read_text())
    for path in sorted(ROOT.glob("packages/*/pyproject.toml"))
}


def test_members_are_the_seven_packages_and_the_kit():
    assert sorted(MEMBERS) == sorted([*PUBLISHED, "testkit"])


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_member_layout(name):
    project = MEMBERS[name]["project"]
    folder = ROOT / "packages" / name
    assert project["name"] == f"ferrule-{name}"
    Version(project["version"])  # a valid version of its own
    for required in [
        "README.md",
        "CHANGELOG.md",
        f"src/ferrule_{name.replace('-', '_')}/__init__.py",
        "tests",
    ]:
        assert (folder / required).exists(), f"packages/{name}/{required} is missing"
    assert project["version"] in (folder / "CHANGELOG.md").read_text(), (
        "CHANGELOG lacks the version"
    )


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_sibling_ranges_admit_the_workspace_versions(name):
    """uv does not check this; a wrong range would otherwise only fail for users of the wheels."""
    project = MEMBERS[name]["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    for requirement in map(Requirement, requirements):
        sibling = requirement.name.removeprefix("ferrule-")
        if requirement.name.startswith("ferrule-") and sibling in MEMBERS:
            version = MEMBERS[sibling]["project"]["version"]
            assert requirement.specifier, f"{name}: {requirement} needs a version range"
            assert version in requirement.specifier, (
                f"packages/{name}/pyproject.toml: {requirement} excludes the workspace's "
                f"ferrule-{sibling} {version}"
            )


def test_the_two_servers_default_to_different_ports():
    """Both listened on 127.0.0.1:50051: a reward server and a rollout server on one machine
    collided unless one was told otherwise."""
    from ferrule_rewards import cli as rewards_cli
    from ferrule_rollout import cli as rollout_cli

    assert rollout_cli.parse_args(["serve", "--model", "m"]).bind == rollout_cli.DEFAULT_BIND
    assert (rewards_cli.DEFAULT_BIND, rollout_cli.DEFAULT_BIND) == (
        "127.0.0.1:50051",
        "127.0.0.1:50052",
    )
