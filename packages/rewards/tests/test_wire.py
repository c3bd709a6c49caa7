"""wire.results: scores to wire results, whole or from a given sample on."""

from ferrule_rewards import wire
from ferrule_rewards.records import Scores, Status


def test_results_from_a_start_equal_the_tail_of_all_results():
    scores = Scores([0.5, 0.0, 0.1 + 0.2, 0.0, 2.0])
    scores.fail(1, Status.ERROR, "boom")
    scores.fail(3, Status.TIMEOUT, "slow")
    scores.sub_scores[4] = {"format": 1.0}
    scores.sub_scores[0] = {"format": 0.0}
    everything = wire.results(scores)
    assert everything[2] == {"reward": 0.1 + 0.2}
    assert everything[1]["error"] == "boom" and everything[4]["sub_scores"] == {"format": 1.0}
    for start in range(len(everything) + 1):
        assert wire.results(scores, start=start) == everything[start:]
