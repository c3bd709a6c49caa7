"""The run's reward service against a real `rlhf-rewards serve` child process on loopback: failed
samples are counted by kind and their first error is reported once; a dead server is started
again, up to the limit."""

import signal
import threading
import time

import pytest

from ferrule_launcher.calls import RunError
from ferrule_launcher.config import RewardsConfig
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
    service = RewardService.start(config, tmp_path)
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
    service = RewardService.start(config, tmp_path)
    try:
        first = service.process
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # the call that finds it dead is answered by its successor, on a new address
        assert service.score([""] * 3, ["ok", "boom", "ok"], [""] * 3).rewards == [1.0, 0.0, 1.0]
        assert service.restarts == 1 and service.process.pid != first.pid
        assert service.process.poll() is None
        err = capsys.readouterr().err
        assert f"pid {first.pid}) was killed by SIGKILL; restarted as pid" in err
        assert "restart 1 of at most 1 in 600 s" in err
        assert (tmp_path / "rewards.log").read_text().count("serving") >= 2  # one log, appended
        # dead while a call is in flight: the client's retries run out, then the limit answers
        service.process.send_signal(signal.SIGKILL)
        service.process.wait(10)
        with pytest.raises(RunError, match=r"was killed by SIGKILL, after 1 restart\(s\) in the"):
            service.score([""], ["ok"], [""])
    finally:
        service.stop()


def test_a_server_given_by_address_is_never_restarted(tmp_path):
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    started = RewardService.start(RewardsConfig(function=f"{tmp_path / 'fns.py'}:picky"), tmp_path)
    given = RewardService.start(
        RewardsConfig(address=started.addresses, retry_for=1), tmp_path / "given"
    )
    try:
        started.process.send_signal(signal.SIGKILL)
        started.process.wait(10)
        with pytest.raises(RunError, match="failed after retries"):
            given.score([""], ["ok"], [""])
        assert given.restarts == 0
    finally:
        given.stop()
        started.stop()


def test_a_server_restarted_from_a_thread_outlives_that_thread(tmp_path):
    """The async loop's producer thread restarts a dead server, then ends; the parent-death
    signal is per thread, so a server it had started itself would die with it."""
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    service = RewardService.start(RewardsConfig(function=f"{tmp_path / 'fns.py'}:picky"), tmp_path)
    try:
        service.process.send_signal(signal.SIGKILL)
        service.process.wait(10)
        producer = threading.Thread(target=service.score, args=([""], ["ok"], [""]))
        producer.start()
        producer.join()
        assert service.restarts == 1
        time.sleep(4)  # past the server's 2 s drain, had the thread's end signalled it
        assert service.process.poll() is None
        assert service.score([""], ["ok"], [""]).rewards == [1.0]
        assert service.restarts == 1
    finally:
        service.stop()


def test_metadata_reaches_the_reward_function(tmp_path):
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    config = RewardsConfig(function=f"{tmp_path / 'fns.py'}:step_of", timeout=30)
    service = RewardService.start(config, tmp_path)
    try:
        metadata = [{"step": "7", "sample_id": "ab/7/0/0"}, {"step": "8", "sample_id": "ab/8/0/12"}]
        scored = service.score(["", ""], ["x", "y"], ["", ""], metadata)
        assert scored.rewards == [7.008, 8.009]
    finally:
        service.stop()
