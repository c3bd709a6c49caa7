"""The run's reward service against a real `rlhf-rewards serve` child process on loopback: failed
samples are counted by kind and their first error is reported once."""

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
