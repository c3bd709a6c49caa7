"""The abuse suite: every attack of abuse.py against one `rlhf-rewards serve` subprocess, each
for a bounded time, while a well-behaved client keeps calling. Throughout: health checks and
normal calls answer within their deadlines, the server's memory stays bounded, and once an
attack is over no scoring process keeps working past a second."""

import importlib.util
import sys
import time
from pathlib import Path

import pytest


def _load(name: str):
    """A helper module of this folder (tests are imported by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


abuse = _load("abuse")

pytestmark = pytest.mark.slow
TOKEN = "abuse-suite-token-0123456789abcdef"
PROCESSES = 2
SERVER_RSS_BOUND = 400 << 20  # the gRPC process: it buffers one request per scoring process


def idle_within(server_pid: int, seconds: float) -> bool:
    """Whether, within `seconds`, the server is down to its PROCESSES scoring processes and
    none of them uses the CPU (over 0.3 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        children = abuse.tree(server_pid)[1:]
        before = sum(map(abuse.cpu_ticks, children))
        time.sleep(0.3)
        after = sum(map(abuse.cpu_ticks, abuse.tree(server_pid)[1:]))
        if len(children) == PROCESSES and after - before <= 1:
            return True
    return False


def test_no_request_freezes_starves_or_bloats_the_server(spawn, fn_spec):
    server = spawn(
        "--function", fn_spec("hostile"), "--timeout", "1", "--call-timeout", "8",
        "--processes", str(PROCESSES), "--max-message-mb", "64",
        env={"FERRULE_REWARDS_TOKEN": TOKEN},
    )  # fmt: skip
    pid = server.process.pid
    watch = abuse.Watch(pid, server.address, TOKEN)
    failures = []
    try:
        time.sleep(0.5)
        for attack in abuse.ATTACKS:
            health_at, health_failed_at, normal_at, normal_failed_at = watch.mark()
            started = time.monotonic()
            answered, sent = attack(server.address, TOKEN)
            took = time.monotonic() - started
            if answered != sent:
                failures.append(f"{attack.__name__}: {answered} of {sent} answered correctly")
            if not idle_within(pid, 1.5):  # every call's deadline has passed by now
                failures.append(f"{attack.__name__}: scoring processes still busy after 1.5 s")
            failures += [
                f"{attack.__name__}: health: {f}" for f in watch.health_failures[health_failed_at:]
            ]
            failures += [
                f"{attack.__name__}: normal call: {f}"
                for f in watch.normal_failures[normal_failed_at:]
            ]
            slowest = max(watch.health_ms[health_at:], default=0)
            normal = max(watch.normal_s[normal_at:], default=0)
            print(
                f"{attack.__name__}: {answered}/{sent} in {took:.1f}s; slowest health check "
                f"{slowest:.0f} ms, slowest normal call {normal:.2f} s"
            )
    finally:
        watch.stop()
    assert not failures, "\n".join(failures)
    assert watch.normal_s and max(watch.normal_s) < abuse.NORMAL_DEADLINE
    assert max(watch.health_ms) < 1000
    assert watch.peak_server_rss < SERVER_RSS_BOUND, watch.peak_server_rss >> 20
    assert server.process.poll() is None
    assert server.stop() == 0
