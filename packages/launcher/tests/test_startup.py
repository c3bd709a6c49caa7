"""The roles' start: every actor created before any is waited for, and where each one's seconds
went, in the start-up lines and summary.json. Ray is a fake here that records the order of
calls; tests/test_launcher_e2e.py starts the real roles."""

import sys
import types

import pytest

from ferrule_launcher.outputs import StartupTimeline
from ferrule_launcher.placement import Role
from ferrule_launcher.roles import RoleSetup, WeightSync, start_roles

ANSWERS = {  # what the fake actors' methods return
    "where": {"host": "127.0.0.1", "port": 29500},
    "setup": {"imports": 3.0, "distributed": 0.2, "weights": 2.0, "deepspeed": 1.0},
    "startup_seconds": {"imports": 1.0, "weights": 0.5},
    "open_sender": "cpu",
}


class Ref:
    def __init__(self, value):
        self.value = value


class FakeRay(types.ModuleType):
    """ray.remote / .options / .remote, ray.get / ray.wait: each call appended to `log`."""

    def __init__(self):
        super().__init__("ray")
        self.log: list[str] = []
        self.refuse: set[str] = set()  # actors whose creation raises
        self.exceptions = types.SimpleNamespace(
            GetTimeoutError=TimeoutError, RayActorError=ChildProcessError, RayTaskError=OSError
        )
        self.util = types.SimpleNamespace(remove_placement_group=lambda group: None)

    def remote(self, cls=None, **options):
        if cls is None:  # ray.remote(concurrency_groups=...)(cls)
            return self.remote
        ray = self

        class Options:
            def options(self, name: str, **options):
                return types.SimpleNamespace(remote=lambda *a, **k: ray._actor(cls, name))

        return Options()

    def _actor(self, cls, name: str):
        if name in self.refuse:
            raise ValueError(f"cannot create {name}")
        self.log.append(f"create {name}")
        ray = self

        class Actor:
            def __getattr__(self, method):
                def call(*args, **kwargs):
                    ray.log.append(f"call {name}.{method}")
                    return Ref(ANSWERS.get(method))

                return types.SimpleNamespace(remote=call)

        return Actor()

    def get(self, ref, timeout=None):
        self.log.append("wait")
        return ref.value

    def wait(self, refs, num_returns=1, timeout=None):
        self.log.append("wait")
        return refs[:num_returns], refs[num_returns:]

    def kill(self, actor, no_restart=True):
        self.log.append("kill")


@pytest.fixture
def ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.exceptions", fake.exceptions)
    return fake


def _start(ray):
    roles = [Role("policy", 0), Role("policy", 1), Role("reference"), Role("critic")]
    roles += [Role("rollout", 0), Role("rollout", 1)]
    setup = RoleSetup(
        model_path="/model",
        policy={},
        reference={},
        critic={},
        engine_class=object,
        engine={},
        seed=0,
        weight_sync=WeightSync("broadcast"),
    )
    ready, phases = {}, {}
    places = {role: {"name": role.label} for role in roles}
    start_roles(setup, places, [], {}, ready=ready, phases=phases)
    return roles, ready, phases


def test_every_actor_is_created_before_any_is_waited_for(ray):
    """Their processes start at once: no role's start waits for another kind's process."""
    roles, _, _ = _start(ray)
    first_wait = ray.log.index("wait")
    created = [entry for entry in ray.log if entry.startswith("create ")]
    assert created == [f"create {role.label}" for role in roles]
    assert ray.log.index(created[-1]) < first_wait
    # the engines were asked for their start before any rank's group met
    asked = [i for i, entry in enumerate(ray.log) if entry.endswith(".startup_seconds")]
    assert len(asked) == 2 and max(asked) < first_wait


def test_each_roles_phases_reach_the_start_up_lines_and_the_summary(ray):
    roles, ready, phases = _start(ray)
    labels = {role.label for role in roles}
    assert ready.keys() == phases.keys() == labels
    assert list(ready.values()) == sorted(ready.values())
    assert list(phases["policy rank 1"]) == ["process", *ANSWERS["setup"]]
    assert list(phases["rollout engine 0"]) == ["process", *ANSWERS["startup_seconds"]]
    assert phases["critic"]["weights"] == 2.0

    timeline = StartupTimeline()
    timeline.mark("ray")
    timeline.roles_ready.update(ready)
    timeline.role_phases.update(phases)
    timeline.mark("roles")
    first, *per_role = timeline.describe().splitlines()
    assert first.startswith("start-up ") and "(ready at: " in first and "critic 0.0" in first
    assert "  rollout engine 1: process 0.0, imports 1.0, weights 0.5 s" in per_role
    assert len(per_role) == len(labels)
    summary = timeline.as_dict()
    assert summary["role_phases"] == phases and summary["roles_ready"] == ready
    assert summary["total"] == pytest.approx(summary["ray"] + summary["roles"], abs=0.02)


def test_actors_created_before_a_failed_creation_are_killed(ray):
    """A reference rank that cannot be created stops the start: the policy ranks already
    created are killed with the rest (the start once kept them out of what it stops)."""
    ray.refuse.add("reference")
    with pytest.raises(ValueError, match="cannot create reference"):
        _start(ray)
    created = [entry for entry in ray.log if entry.startswith("create ")]
    assert created == ["create policy rank 0", "create policy rank 1"]
    assert ray.log.count("kill") == 2
