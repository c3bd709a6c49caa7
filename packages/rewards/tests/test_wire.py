"""wire: scores to wire results, results to the bytes of a ScoreResponse, and the budget that
keeps a response within the message limit."""

from ferrule_rewards import rewards_pb2 as pb
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


def test_chunks_joined_are_the_response():
    """The server joins results' bytes without decoding them: that must be the response."""
    results = [
        {"reward": 0.0},
        {"reward": -1.5},
        {"reward": 1.1, "sub_scores": {"accuracy": 1.0, "format": 1.0}},
        wire.failure(Status.TIMEOUT, "slow"),
        wire.MISSING_RESPONSE,
    ]
    joined = b"".join(map(wire.chunk, results)) + wire.float_chunk(3.0)
    expected = pb.ScoreResponse(results=[*results, {"reward": 3.0}])
    assert pb.ScoreResponse.FromString(joined) == expected


def test_a_budget_fails_the_results_that_do_not_fit_and_keeps_room_for_the_rest():
    big = {"reward": 1.0, "sub_scores": {f"s{i}": 1.0 for i in range(100)}}  # ~1.6 kB
    budget = wire.Budget(max_bytes=5000, max_sub_scores=100, left=4)
    chunks = [budget.fit(result) for result in (big, big, big, {"reward": 2.0})]
    reply = pb.ScoreResponse.FromString(b"".join(chunks))
    assert [r.status for r in reply.results] == [
        pb.SAMPLE_STATUS_OK, pb.SAMPLE_STATUS_OK, pb.SAMPLE_STATUS_ERROR, pb.SAMPLE_STATUS_OK
    ]  # fmt: skip
    assert "message limit" in reply.results[2].error and len(b"".join(chunks)) <= 5000
    too_many = wire.Budget(max_bytes=1 << 20, max_sub_scores=99, left=1).fit(big)
    result = pb.ScoreResponse.FromString(too_many).results[0]
    assert result.status == pb.SAMPLE_STATUS_INVALID_REWARD and "100 sub-scores" in result.error
