"""Both engines implement `interface.Engine`, every verb with the same parameters, so the
launcher, the server and the episode runner can take either."""

import inspect

import pytest

from ferrule_rollout.hf_engine import TransformersEngine
from ferrule_rollout.interface import Engine
from ferrule_rollout.vllm_engine import VLLMEngine

VERBS = [
    name
    for name, member in vars(Engine).items()
    if not name.startswith("_") and (callable(member) or isinstance(member, property))
]


def test_the_interface_names_every_verb_the_callers_use():
    assert set(VERBS) >= {
        "generate",
        "generate_stream",
        "run_episodes",
        "pause",
        "resume",
        "paused",
        "version",
        "init_weight_sync",
        "update_weights",
        "sleep",
        "wake_up",
        "health",
        "startup_seconds",
        "close",
    }


@pytest.mark.parametrize("engine", [VLLMEngine, TransformersEngine])
@pytest.mark.parametrize("verb", VERBS)
def test_each_engine_has_the_verb_with_its_parameters(engine, verb):
    wanted, found = getattr(Engine, verb), getattr(engine, verb, None)
    assert found is not None, f"{engine.__name__} has no {verb}"
    if isinstance(wanted, property):
        assert isinstance(found, property), f"{engine.__name__}.{verb} is not a property"
        return
    expected = list(inspect.signature(wanted).parameters)
    # an engine may take more, never fewer or others
    assert list(inspect.signature(found).parameters)[: len(expected)] == expected, verb
