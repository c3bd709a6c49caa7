"""What a client or a reward function can do to the server, and what it must not: a request
sent slowly, a function that floods its output, forks children or returns huge sub-scores, a
process that dies after finishing samples. Real servers on loopback, real scoring processes."""

import threading
import time

import grpc

from ferrule_rewards import rewards_pb2 as pb
from ferrule_rewards.client import METHOD
from ferrule_rewards.server import Limits


def request(*samples: dict) -> bytes:
    return pb.ScoreRequest(samples=list(samples)).SerializeToString()


def statuses(reply: pb.ScoreResponse) -> list[str]:
    return [pb.SampleStatus.Name(r.status)[14:] for r in reply.results]


def test_a_slow_sender_holds_no_scoring_process(serve):
    """The body was read while holding a scoring process, with no timeout: a client that
    never finished sending held the only process past the call timeout, and every other call
    failed. Now the body is read first, within the call's deadline."""
    server = serve("length", processes=1, limits=Limits(call_timeout=2.0))
    never = threading.Event()

    def body_that_never_comes():
        never.wait(20)  # the stream is open; the message never arrives
        yield request({"response": "x"})

    with grpc.insecure_channel(server.address) as channel:
        slow = channel.stream_unary(METHOD).future(body_that_never_comes())
        time.sleep(0.3)  # the slow call is admitted and reading
        call = channel.unary_unary(METHOD, response_deserializer=pb.ScoreResponse.FromString)
        started = time.monotonic()
        assert call(request({"response": "abc"}), timeout=1.5).results[0].reward == 3.0
        assert time.monotonic() - started < 1.0
        try:
            slow.result(timeout=5)
            raise AssertionError("the slow call was answered")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert "did not arrive" in error.details()
        finally:
            never.set()
    assert server.server.busy == 0
