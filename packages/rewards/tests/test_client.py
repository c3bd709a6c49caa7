"""The client: chunking, deadlines, retries with backoff, load spread and failover."""

import math
import threading
import time
from collections import Counter

import grpc
import pytest

from ferrule_rewards.client import RewardClient, RewardError, RewardServersUnavailable
from ferrule_rewards.records import Sample, Status
from ferrule_rewards.server import Limits


def calls(log) -> int:
    """How many samples the `pid` reward function has been called on (lines in its log)."""
    return len(log.read_text().splitlines()) if log.exists() else 0


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


def test_a_call_past_its_deadline_answers_in_time_and_is_not_retried(serve, tmp_path, monkeypatch):
    """The server answers just before the client's deadline, with TIMEOUT for what it could
    not score; when it cannot even start (no scoring process free), DEADLINE_EXCEEDED raises at
    once. Neither is retried: that would score samples twice."""
    log = tmp_path / "calls"
    monkeypatch.setenv("REWARDS_TEST_LOG", str(log))
    server = serve("pid")
    # 1 s: the server answers 0.25 s ahead of it (server.ANSWER_AHEAD); 50 ms (at 0.5 s) and
    # 100 ms were too little for the answer to cross the front's relay on a loaded 2-core machine
    with RewardClient(server.address, timeout=1.0) as client:
        started = time.monotonic()
        [result] = client.score([{"response": "2.0"}])
        assert time.monotonic() - started < 1.0
        assert result.status == Status.TIMEOUT and "deadline" in result.error
        hog = threading.Thread(
            target=lambda: RewardClient(server.address).score([{"response": "2"}])
        )
        hog.start()
        while calls(log) < 2:  # the only scoring process is busy for 2 s
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(RewardError) as error:
            client.score([{"response": ""}])
        assert time.monotonic() - started < 1.4
        hog.join()
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "before a scoring process was free" in str(error.value)
    assert error.value.address == server.address
    assert calls(log) == 2  # the first call's sample and the hog's, once each


def test_non_retryable_errors_raise_with_their_status(serve):
    server = serve(limits=Limits(max_batch=4))
    with RewardClient(server.address, batch_size=8) as client, pytest.raises(RewardError) as error:
        client.score(samples(8))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "over this server's limit of 4" in str(error.value)


def test_a_call_too_large_for_the_server_is_not_retried(serve):
    server = serve(limits=Limits(max_message_bytes=1 << 16, max_batch=1024))
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


def test_load_is_spread_over_replicas_and_fails_over(serve):
    one, two = serve("pid"), serve("pid")
    work = [{"response": "0.001"}] * 200
    with RewardClient([one.address, two.address], batch_size=10, max_in_flight=4) as client:
        results = client.score(work)
        assert all(r.reward == 1.0 for r in results)
        by_process = Counter(r.sub_scores["pid"] for r in results)
        assert len(by_process) == 2 and min(by_process.values()) > 40  # both took a fair share
        one.stop(grace=1)
        results = client.score(work)
        assert all(r.reward == 1.0 for r in results)
        assert len({r.sub_scores["pid"] for r in results}) == 1  # the survivor scored all


def test_busy_servers_send_the_call_elsewhere(serve):
    """RESOURCE_EXHAUSTED (the concurrency limit) moves a chunk to the next replica."""
    busy, free = serve("pid", limits=Limits(max_concurrency=1)), serve("pid")
    hog = threading.Thread(target=lambda: RewardClient(busy.address).score([{"response": "1"}]))
    hog.start()
    while busy.server.busy < 1:
        time.sleep(0.01)
    with RewardClient([busy.address, free.address]) as client:
        pids = [client.score([{"response": ""}])[0].sub_scores["pid"] for _ in range(4)]
    hog.join()
    assert len(set(pids)) == 1  # whichever address the round-robin tried first: the free one


def test_failed_samples_read_as_nan_with_a_status(serve):
    server = serve("misbehaving")
    with RewardClient(server.address) as client:
        ok, failed = client.score([{"response": "ab"}, {"response": "raise"}])
    assert ok.ok and ok.reward == 2.0 and ok.error == ""
    assert not failed.ok and failed.status == Status.ERROR and math.isnan(failed.reward)
