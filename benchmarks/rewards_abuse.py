"""Reward server reliability under attack: every attack of packages/rewards/tests/abuse.py in
turn against one `rlhf-rewards serve` process, while a well-behaved client keeps calling.

    uv run python benchmarks/rewards_abuse.py [--processes 2]

For each attack: calls answered as they should be, of those sent; the health check's latency
(p50, p99, max) and the normal calls' (max; each must be answered correctly within 5 s); and,
over the whole run, the peak memory of the gRPC process and of the whole tree (it plus its
scoring processes). There is no baseline server here: the code before issue 17 froze on the
first attack (see benchmarks/RESULTS.md). Last line: one JSON object; `ratio` is the share of
attack calls answered as they should be.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "packages" / "rewards" / "tests"
TOKEN = "benchmark-token-0123456789abcdef"


def load_abuse():
    spec = importlib.util.spec_from_file_location("abuse", TESTS / "abuse.py")
    module = sys.modules["abuse"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    abuse = load_abuse()
    command = [
        sys.executable, "-m", "ferrule_rewards", "serve", "--bind", "127.0.0.1:0",
        "--function", f"{TESTS / 'reward_fns.py'}:hostile", "--timeout", "1",
        "--call-timeout", "8", "--processes", str(args.processes),
    ]  # fmt: skip
    env = {**os.environ, "FERRULE_REWARDS_TOKEN": TOKEN}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    address = (
        next(line for line in server.stderr if " serving " in line).split(" on ")[1].split()[0]
    )
    watch = abuse.Watch(server.pid, address, TOKEN)
    rows = []
    try:
        time.sleep(0.5)
        for attack in abuse.ATTACKS:
            health_at, health_failed_at, normal_at, normal_failed_at = watch.mark()
            started = time.monotonic()
            answered, sent = attack(address, TOKEN)
            took = time.monotonic() - started
            time.sleep(1.0)  # what the attack left behind shows in the figures too
            health = watch.health_ms[health_at:]
            rows.append(
                {
                    "attack": attack.__name__,
                    "answered": answered,
                    "sent": sent,
                    "seconds": round(took, 2),
                    "health_ms_p50": round(percentile(health, 50), 1),
                    "health_ms_p99": round(percentile(health, 99), 1),
                    "health_ms_max": round(max(health), 1),
                    "health_failures": len(watch.health_failures) - health_failed_at,
                    "normal_calls": len(watch.normal_s) - normal_at,
                    "normal_s_max": round(max(watch.normal_s[normal_at:], default=0), 3),
                    "normal_failures": len(watch.normal_failures) - normal_failed_at,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        watch.stop()
        server.terminate()
        server.wait(30)
    answered = sum(row["answered"] for row in rows)
    sent = sum(row["sent"] for row in rows)
    print(
        json.dumps(
            {
                "name": "rewards_abuse",
                "processes": args.processes,
                "cpus": os.cpu_count(),
                "attacks": rows,
                "peak_rss_mb": {
                    "server": watch.peak_server_rss >> 20,
                    "with_scoring_processes": watch.peak_tree_rss >> 20,
                },
                "normal_failures": len(watch.normal_failures),
                "health_failures": len(watch.health_failures),
                "goal": "every attack call answered as it should; no normal call or health check fails",
                "ratio": round(answered / sent, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
