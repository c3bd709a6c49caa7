"""The abuse suite: every attack of abuse.py against one `rlhf-rewards serve` subprocess, each
for a bounded time, while a well-behaved client keeps calling. Throughout: health checks and
normal calls answer within their deadlines, the server's memory stays bounded, and once an
attack is over no scoring process keeps working past a second."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _load(name: str):
    """A helper module of this folder (tests are imported by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


abuse = _load("abuse")

pytestmark = pytest.mark.soak
TOKEN = "abuse-suite-token-0123456789abcdef"
PROCESSES = 2
SERVER_RSS_BOUND = 400 << 20  # the gRPC process: it buffers one request per scoring process
LOG_BOUND = 8 << 20  # the 1 MiB default of --max-log-mb, for each of a few scoring processes


def test_no_request_freezes_starves_or_bloats_the_server(spawn, fn_spec):
    server = spawn(
        "--function", fn_spec("hostile"), "--timeout", "1", "--call-timeout", "8",
        "--processes", str(PROCESSES), "--max-message-mb", "64",
        env={"FERRULE_REWARDS_TOKEN": TOKEN},
    )  # fmt: skip
    rows, watch = abuse.run_all(server.process.pid, server.address, TOKEN, PROCESSES)
    failures = []
    for row in rows:
        name = row["attack"]
        print(row)
        if row["answered"] != row["sent"]:
            failures.append(f"{name}: {row['answered']} of {row['sent']} answered correctly")
        if not row["idle_after"]:
            failures.append(f"{name}: not idle 1.5 s after the attack: {row['busy_after']}")
        failures += [f"{name}: health: {f}" for f in row["health_failures"]]
        failures += [f"{name}: normal call: {f}" for f in row["normal_failures"]]
    # Every health check (1 s deadline) and normal call (5 s) in time: gRPC enforces them.
    log = "".join(server.log[-60:])
    assert not failures, "\n".join(failures) + f"\nthe server's log, its end:\n{log}"
    assert watch.normal_s and watch.health_ms
    assert watch.peak_server_rss < SERVER_RSS_BOUND, watch.peak_server_rss >> 20
    # 80 MiB of prints (output_flood) reach the log as --max-log-mb per scoring process.
    logged = sum(map(len, server.log))
    print({"log_bytes": logged, "peak_server_rss_mb": watch.peak_server_rss >> 20})
    assert logged < LOG_BOUND, logged
    assert server.process.poll() is None
    assert server.stop() == 0
