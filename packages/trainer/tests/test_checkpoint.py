"""Resumable state: what save_state writes, and the seconds it reports by part."""

import pytest

from ferrule_testkit import tiny_model


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_save_state_reports_its_seconds_by_part_and_loads_back(tmp_path, zero_stage):
    from ferrule_trainer.actor import Actor

    actor = Actor(tiny_model("qwen2"), zero_stage=zero_stage, dtype="float32", learning_rate=1e-2)
    writer = actor.engine.checkpoint_engine
    saved = actor.save_state(tmp_path / "state", step=7, data_position=56)

    assert saved.tag == "step7" and (tmp_path / "state" / "latest").read_text() == "step7"
    optimizer_files = list((tmp_path / "state" / "step7").glob("*optim_states.pt"))
    seconds = saved.seconds
    assert seconds["weights"] > 0
    if zero_stage:  # ZeRO's optimizer states are a file of their own
        assert optimizer_files and seconds["optimizer"] > 0
    else:  # without ZeRO they are inside the model states: counted as weights
        assert not optimizer_files and seconds["optimizer"] == 0
    assert seconds["total"] >= seconds["weights"] + seconds["optimizer"]
    assert "save" not in vars(writer)  # the timing wrapper is gone: the class's method again
    assert actor.load_state(tmp_path / "state") == {"step": 7, "data_position": 56}
