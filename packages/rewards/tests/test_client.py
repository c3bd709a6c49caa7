"""The client: chunking, deadlines, retries with backoff, load spread and failover."""

import math
import threading
import time

import grpc
import pytest

from ferrule_rewards.client import RewardClient, RewardError, RewardServersUnavailable
from ferrule_rewards.functions import FunctionScorer
from ferrule_rewards.records import Sample, Status
from ferrule_rewards.server import BackgroundServer, Limits


class Counting:
    """A reward function that counts its calls: reward = len(response)."""

    def __init__(self, delay: float = 0.0):
        self.calls, self.delay = 0, delay

    def __call__(self, response: str) -> float:
        self.calls += 1
        time.sleep(self.delay)
        return float(len(response))


def samples(n: int) -> list[dict]:
    return [{"response": "x" * (i % 7), "metadata": {"i": str(i)}} for i in range(n)]


def test_big_calls_are_split_and_come_back_in_order(serve):
    server = serve(limits=Limits(max_batch=16))
    with RewardClient(server.address, batch_size=16, max_in_flight=3) as client:
        results = client.score(samples(100))
        assert [r.reward for r in results] == [float(i % 7) for i in range(100)]
        assert client.score([]) == []
        # records.Sample works as well as a dict
        assert client.score([Sample(response="abcd")])[0].reward == 4.0


def test_bad_samples_are_named_before_anything_is_sent(serve):
    server = serve()
    with RewardClient(server.address, batch_size=2) as client:
        with pytest.raises(ValueError, match=r"sample 3: .*no \"answer\" field"):
            client.score([{"response": "a"}] * 3 + [{"answer": "b"}])
        with pytest.raises(ValueError, match=r"sample 1: .*surrogates not allowed"):
            client.score([{"response": "a"}, {"response": "\udcff"}])


def test_a_deadline_raises_at_once_and_is_not_retried():
    slow = Counting(delay=1.0)
    with BackgroundServer(FunctionScorer(slow)) as server:
        with RewardClient(server.address, timeout=0.2) as client:
            started = time.monotonic()
            with pytest.raises(RewardError) as error:
                client.score([{"response": "a"}])
            assert time.monotonic() - started < 0.9
        assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.value.address == server.address
        time.sleep(1.0)
        assert slow.calls == 1  # retrying would have scored the sample twice


def test_non_retryable_errors_raise_with_their_status(serve):
    server = serve(limits=Limits(max_batch=4))
    with RewardClient(server.address, batch_size=8) as client, pytest.raises(RewardError) as error:
        client.score(samples(8))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "over this server's limit of 4" in str(error.value)


def test_a_call_too_large_for_the_server_is_not_retried(serve):
    server = serve(limits=Limits(max_message_bytes=1 << 16))
    with RewardClient(server.address, retry_for=30) as client:
        started = time.monotonic()
        with pytest.raises(RewardError) as error:
            client.score([{"response": "x" * (1 << 17)}])
        assert time.monotonic() - started < 5
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in str(error.value)


def test_retries_with_backoff_until_the_server_comes_up(serve, free_port):
    port = free_port()
    outcome = {}

    def late_start():
        time.sleep(0.7)
        outcome["server"] = serve(bind=f"127.0.0.1:{port}")

    starter = threading.Thread(target=late_start)
    starter.start()
    with RewardClient(f"127.0.0.1:{port}", backoff=0.05, max_backoff=0.3) as client:
        started = time.monotonic()
        assert client.score([{"response": "abc"}])[0].reward == 3.0
        assert time.monotonic() - started >= 0.6  # it waited for the server
    starter.join()


def test_all_servers_down_is_one_clear_exception(free_port):
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with RewardClient(dead, retry_for=1.0, backoff=0.05, max_backoff=0.2) as client:
        started = time.monotonic()
        with pytest.raises(RewardServersUnavailable) as error:
            client.score([{"response": "a"}])
        assert 0.7 < time.monotonic() - started < 3  # retried with backoff, for about 1 s
    message = str(error.value)
    assert "attempts over 2 address(es) and 1s" in message
    for address in dead:
        assert f"{address}: UNAVAILABLE" in message


def test_load_is_spread_over_replicas_and_fails_over():
    first, second = Counting(delay=0.001), Counting(delay=0.001)
    with (
        BackgroundServer(FunctionScorer(first)) as one,
        BackgroundServer(FunctionScorer(second)) as two,
        RewardClient([one.address, two.address], batch_size=10, max_in_flight=4) as client,
    ):
        assert [r.reward for r in client.score(samples(200))] == [i % 7 for i in range(200)]
        assert first.calls > 40 and second.calls > 40  # both took a fair share
        one.stop(grace=1)
        before = second.calls
        results = client.score(samples(200))
        assert [r.reward for r in results] == [i % 7 for i in range(200)]
        assert second.calls - before == 200  # the survivor scored all, each once


def test_busy_servers_send_the_call_elsewhere():
    """RESOURCE_EXHAUSTED (the concurrency limit) moves a chunk to the next replica."""
    slow, fast = Counting(delay=0.5), Counting()
    with (
        BackgroundServer(FunctionScorer(slow), limits=Limits(max_concurrency=1)) as busy,
        BackgroundServer(FunctionScorer(fast)) as free,
    ):
        hog = threading.Thread(target=lambda: RewardClient(busy.address).score([{"response": "a"}]))
        hog.start()
        while busy.server.busy < 1:
            time.sleep(0.01)
        with RewardClient([busy.address, free.address]) as client:
            for _ in range(4):  # whichever address the round-robin tries first
                assert client.score([{"response": "ab"}])[0].reward == 2.0
        hog.join()
        assert slow.calls == 1 and fast.calls == 4


def test_failed_samples_read_as_nan_with_a_status(serve):
    server = serve("misbehaving")
    with RewardClient(server.address) as client:
        ok, failed = client.score([{"response": "ab"}, {"response": "raise"}])
    assert ok.ok and ok.reward == 2.0 and ok.error == ""
    assert not failed.ok and failed.status == Status.ERROR and math.isnan(failed.reward)
