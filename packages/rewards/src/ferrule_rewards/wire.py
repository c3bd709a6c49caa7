"""The bytes of the Score call: a ScoreRequest is decoded into rows for a scorer, and results
are encoded into a ScoreResponse. This code runs in the scoring processes (child.py), never on
the server's event loop: decoding a large request takes seconds, and health checks must not
wait for it.

The bytes of a ScoreResponse are the bytes of its results one after another (each is a
`results` field). So a scoring process encodes each result as a `chunk`, and the server joins
the chunks in order without decoding any. `Budget` keeps the whole response within the
server's message limit.
"""

import struct
from operator import attrgetter, methodcaller

from google.protobuf.message import DecodeError

from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.records import Scores, Status

STATUS_TO_WIRE = {
    status: pb.SampleStatus.Value(f"SAMPLE_STATUS_{status.name}") for status in Status
}
MISSING_RESPONSE = {
    "status": STATUS_TO_WIRE[Status.INVALID_SAMPLE],
    "error": "sample has no `response` (send an empty string for an empty generation)",
}
_HAS_RESPONSE = methodcaller("HasField", "response")
_CONTAINERS = {"metadata": dict, "prompt_token_ids": list, "response_token_ids": list}


class InvalidRequest(ValueError):
    """The server does not score this request: the call fails with INVALID_ARGUMENT and this
    message."""


def decode(body, max_batch: int) -> list:
    """Return the samples of a serialized ScoreRequest, or raise InvalidRequest saying what is
    wrong."""
    try:
        samples = pb.ScoreRequest.FromString(body).samples
    except DecodeError as error:
        raise InvalidRequest(f"bad ScoreRequest: {error}") from None
    if not samples:
        raise InvalidRequest("empty batch: no samples")
    if len(samples) > max_batch:
        raise InvalidRequest(
            f"batch of {len(samples)} samples is over this server's limit of {max_batch}; "
            "split it into smaller calls"
        )
    return list(samples)  # one Python wrapper per sample, reused by every pass after this


def without_response(samples: list) -> list[int]:
    """Indices of the samples that have no `response` (they get MISSING_RESPONSE)."""
    if all(map(_HAS_RESPONSE, samples)):
        return []
    return [index for index, sample in enumerate(samples) if not sample.HasField("response")]


def rows(samples: list, fields: tuple[str, ...]) -> list[tuple]:
    """The fields a scorer takes, one tuple per sample. Only those fields are read: turning
    protobuf values into Python ones is most of the work on a large batch."""
    values = list(map(attrgetter(*fields), samples))
    if len(fields) == 1:
        values = [(value,) for value in values]
    converts = [(i, _CONTAINERS[f]) for i, f in enumerate(fields) if f in _CONTAINERS]
    if converts:  # protobuf containers become plain dicts and lists
        values = [list(row) for row in values]
        for row in values:
            for i, make in converts:
                row[i] = make(row[i])
        values = [tuple(row) for row in values]
    return values


def results(scores: Scores, start: int = 0) -> list[dict]:
    """One wire result (a dict for pb.Result) per score, from the `start`-th on."""
    out = [{"reward": reward} for reward in scores.rewards[start:]]
    for index, (status, message) in scores.errors.items():
        if index >= start:
            out[index - start] = {"status": STATUS_TO_WIRE[status], "error": message}
    for index, subs in scores.sub_scores.items():
        if index >= start:
            out[index - start]["sub_scores"] = subs
    return out


def failure(status: Status, message: str) -> dict:
    return {"status": STATUS_TO_WIRE[status], "error": message}


SMALL = 256
"""Bytes that a Budget reserves for each result still to come. A failed result with a short
message, such as the ERROR that Budget itself writes, takes less than this. So every sample
gets a result within the limit."""
_FLOAT_CHUNK = b"\x0a\x09\x09"  # results (field 1), 9 bytes: reward (field 1), a double
_DOUBLE = struct.Struct("<d")


def chunk(result: dict) -> bytes:
    """One wire result as the bytes it takes in a ScoreResponse."""
    if len(result) == 1 and "reward" in result:  # most results: no need for protobuf
        return _FLOAT_CHUNK + _DOUBLE.pack(result["reward"])
    return pb.ScoreResponse(results=[result]).SerializeToString()


def float_chunk(reward: float) -> bytes:
    return _FLOAT_CHUNK + _DOUBLE.pack(reward)


def failure_chunk(status: Status, message: str) -> bytes:
    return chunk(failure(status, message[:200]))


MISSING_CHUNK = chunk(MISSING_RESPONSE)
OVER_LIMIT_CHUNK = failure_chunk(Status.ERROR, "response past --max-message-mb")
"""The result a sample gets when the response has no room left for its own result. `within`
can shrink every result to at most this size, so a server refuses to start when --max-batch
results of this size exceed its message limit (server.Limits)."""


def within(chunks: list[bytes], max_bytes: int) -> list[bytes]:
    """Replace results longer than OVER_LIMIT_CHUNK with it, the last ones first, until
    `chunks` take at most `max_bytes` in all. Every sample keeps a result, and the replaced ones
    are an ERROR. Budget already fails a huge result as it comes; this function also covers
    what Budget does not see (the server's TIMEOUT and ERROR results, samples without a
    response)."""
    total, small = sum(map(len, chunks)), len(OVER_LIMIT_CHUNK)
    index = len(chunks)
    while total > max_bytes and index:
        index -= 1
        if len(chunks[index]) > small:
            total -= len(chunks[index]) - small
            chunks[index] = OVER_LIMIT_CHUNK
    return chunks


class Budget:
    """What a response may still take. A result with more than `max_sub_scores` sub-scores
    becomes an INVALID_REWARD for its sample. A result that would take the response past
    `max_bytes` becomes an ERROR for its sample; the check counts SMALL bytes for each of the
    `left` results still to come. So a huge result fails its own sample, never the whole
    call."""

    def __init__(self, max_bytes: int, max_sub_scores: int, left: int, used: int = 0):
        self.max_bytes, self.max_sub_scores = max_bytes, max_sub_scores
        self.left, self.used = left, used

    def fit(self, result: dict) -> bytes:
        subs = result.get("sub_scores")
        if subs is not None and len(subs) > self.max_sub_scores:
            data = chunk(self.too_many(len(subs)))
        else:
            data = chunk(result)
        self.left -= 1
        if len(data) > SMALL and self.used + len(data) + SMALL * self.left > self.max_bytes:
            data = failure_chunk(
                Status.ERROR,
                f"its result ({len(data)} bytes) would take the response past this server's "
                "message limit (--max-message-mb); return fewer or shorter sub-scores",
            )
        self.used += len(data)
        return data

    def too_many(self, count: int) -> dict:
        return failure(
            Status.INVALID_REWARD,
            f"{count} sub-scores, over this server's limit of {self.max_sub_scores} "
            "(--max-sub-scores)",
        )
