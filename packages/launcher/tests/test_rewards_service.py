"""The run's reward service against a real `rlhf-rewards serve` child process on loopback: failed
samples are counted by kind and their first error is reported once; a dead server is started
again, up to the limit. A reward model is served by a Ray role of its own."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ferrule_launcher.calls import RunError
from ferrule_launcher.config import RayConfig, RewardsConfig
from ferrule_launcher.rewards_service import RewardService

FUNCTIONS = '''
def picky(response: str) -> float:
    """Raises on "boom...", returns NaN on "nan", 1.0 otherwise."""
    if response.startswith("boom"):
        raise ValueError(f"cannot score {response!r}")
    if response == "nan":
        return float("nan")
    return 1.0


def step_of(response: str, metadata: dict) -> float:
    return float(metadata["step"]) + len(metadata["sample_id"]) / 1000
'''


def test_failures_are_counted_by_kind_and_each_kind_reported_once(tmp_path, capsys):
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    config = RewardsConfig(function=f"{tmp_path / 'fns.py'}:picky", timeout=30)
    service = RewardService.start(config, RayConfig(), tmp_path)
    try:
        responses = ["ok", "boom1", "nan", "boom2", "ok", "ok"]
        scored = service.score([""] * 6, responses, [""] * 6)
        assert scored.rewards == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        assert dict(scored.failed) == {"error": 2, "invalid_reward": 1}
        assert scored.failed_fraction == 0.5
        assert "cannot score 'boom1'" in scored.first_errors["error"]
        service.report_new_failures(scored)
        service.report_new_failures(service.score([""], ["boom3"], [""]))  # a kind seen before
        err = capsys.readouterr().err
        assert err.count("a sample failed (error)") == 1 and "cannot score 'boom1'" in err
        assert err.count("a sample failed (invalid_reward)") == 1
        assert str(tmp_path / "fns.py") in err  # names the function
        clean = service.score([""] * 2, ["ok", "ok"], [""] * 2)
        assert clean.failed_fraction == 0 and not clean.first_errors
    finally:
        service.stop()


def test_a_dead_server_is_restarted_up_to_the_limit_and_then_stops_the_run(tmp_path, capsys):
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    config = RewardsConfig(
        function=f"{tmp_path / 'fns.py'}:picky", timeout=30, retry_for=2, max_restarts=1
    )
    service = RewardService.start(config, RayConfig(), tmp_path)
    try:
        first = service.server.process
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # the call that finds it dead is answered by its successor, on a new address
        assert service.score([""] * 3, ["ok", "boom", "ok"], [""] * 3).rewards == [1.0, 0.0, 1.0]
        assert service.restarts == 1 and service.server.process.pid != first.pid
        assert service.server.process.poll() is None
        err = capsys.readouterr().err
        assert f"pid {first.pid}) was killed by SIGKILL; restarted as the reward server (pid" in err
        assert "restart 1 of at most 1 in 600 s" in err
        assert (tmp_path / "rewards.log").read_text().count("serving") >= 2  # one log, appended
        # dead while a call is in flight: the client's retries run out, then the limit answers
        service.server.process.send_signal(signal.SIGKILL)
        service.server.process.wait(10)
        with pytest.raises(RunError, match=r"was killed by SIGKILL, after 1 restart\(s\) in the"):
            service.score([""], ["ok"], [""])
    finally:
        service.stop()


def test_a_server_given_by_address_is_never_restarted(tmp_path):
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    started = RewardService.start(
        RewardsConfig(function=f"{tmp_path / 'fns.py'}:picky"), RayConfig(), tmp_path
    )
    given = RewardService.start(
        RewardsConfig(address=started.addresses, retry_for=1), RayConfig(), tmp_path / "given"
    )
    try:
        started.server.process.send_signal(signal.SIGKILL)
        started.server.process.wait(10)
        with pytest.raises(RunError, match="failed after retries"):
            given.score([""], ["ok"], [""])
        assert given.restarts == 0
    finally:
        given.stop()
        started.stop()


@pytest.mark.e2e  # ~5-10 s of subprocesses (the fast tier stays under 10 minutes)
def test_a_server_restarted_from_a_thread_outlives_that_thread(tmp_path):
    """The async loop's producer thread restarts a dead server, then ends; the parent-death
    signal is per thread, so a server it had started itself would die with it."""
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    service = RewardService.start(
        RewardsConfig(function=f"{tmp_path / 'fns.py'}:picky"), RayConfig(), tmp_path
    )
    try:
        service.server.process.send_signal(signal.SIGKILL)
        service.server.process.wait(10)
        producer = threading.Thread(target=service.score, args=([""], ["ok"], [""]))
        producer.start()
        producer.join()
        assert service.restarts == 1
        time.sleep(4)  # past the server's 2 s drain, had the thread's end signalled it
        assert service.server.process.poll() is None
        assert service.score([""], ["ok"], [""]).rewards == [1.0]
        assert service.restarts == 1
    finally:
        service.stop()


def test_metadata_reaches_the_reward_function(tmp_path):
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    config = RewardsConfig(function=f"{tmp_path / 'fns.py'}:step_of", timeout=30)
    service = RewardService.start(config, RayConfig(), tmp_path)
    try:
        metadata = [{"step": "7", "sample_id": "ab/7/0/0"}, {"step": "8", "sample_id": "ab/8/0/12"}]
        scored = service.score(["", ""], ["x", "y"], ["", ""], metadata)
        assert scored.rewards == [7.008, 8.009]
    finally:
        service.stop()


def _reward_model(folder: Path) -> Path:
    """A tiny sequence-classification model (one output) with saved moments, as `rlhf-train rm`
    leaves one."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from ferrule_testkit import tiny_model

    source = tiny_model("qwen2")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(source, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    (folder / "reward_stats.json").write_text(json.dumps({"mean": 0.25, "std": 0.5}))
    return folder


@pytest.mark.e2e
def test_a_reward_model_is_served_by_a_ray_role_of_its_own(tmp_path):
    """[rewards] model: ferrule-rewards' model backend in a Ray actor with the resources asked
    for, on loopback behind a token, scoring as the model does in process (normalised by its
    saved moments); killed, it is started again and scores the same."""
    import grpc
    import ray

    from ferrule_rewards.client import RewardClient, RewardError
    from ferrule_rewards.model import ModelScorer

    folder = _reward_model(tmp_path / "rm")
    rows = [("Reverse the string abc. Answer:", " cba"), ("Reverse the string xyz.", " zy")]
    expected = ModelScorer(folder, device="cpu", normalize=True).score(rows).rewards
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # 300 s: a loaded 2-core CI machine once took over 120 s to start the role
    config = RewardsConfig(model=folder, normalize=True, cpus=1.5, start_timeout=300)
    service = None
    try:  # Ray is shut down however this ends: the next test starts its own
        service = RewardService.start(config, RayConfig(), tmp_path)
        where = service.where()
        assert where["pid"] != os.getpid() and where["address"].startswith("127.0.0.1:")
        assert ray.available_resources()["CPU"] == pytest.approx(0.5)  # [rewards] cpus = 1.5
        scored = service.score([p for p, _ in rows], [r for _, r in rows], ["", ""])
        assert scored.rewards == pytest.approx(expected, abs=1e-4) and not scored.failed
        assert expected[0] != expected[1]
        stranger = RewardClient(where["address"], token="x" * 32, retry_for=0)
        with stranger, pytest.raises(RewardError) as refused:
            stranger.score([{"prompt": "a", "response": "b"}])
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "serving the reward model" in (tmp_path / "rewards.log").read_text()

        ray.kill(service.server.actor)
        # ray.kill returns before the process is gone: a call made sooner could reach the old
        # server, still alive, and succeed without a restart (CI, 2026-12-01)
        deadline = time.monotonic() + 60
        while not service.server.dead():
            assert time.monotonic() < deadline, "the killed actor still answers after 60 s"
            time.sleep(0.1)
        again = service.score([p for p, _ in rows], [r for _, r in rows], ["", ""])
        assert again.rewards == pytest.approx(expected, abs=1e-4)
        assert service.restarts == 1 and service.where()["pid"] != where["pid"]
    finally:
        if service is not None:
            service.stop()
        ray.shutdown()


@pytest.mark.e2e
def test_a_reward_model_that_does_not_load_stops_the_run_naming_it(tmp_path):
    import ray

    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    # the role must start (import torch and transformers) before it can fail to load the
    # model: a loaded 2-core CI machine once took longer than the default 60 s for that
    config = RewardsConfig(model=folder, start_timeout=300)
    try:
        with pytest.raises(RunError, match=r"reward model .*not-a-model did not load"):
            RewardService.start(config, RayConfig(), tmp_path)
    finally:
        ray.shutdown()
