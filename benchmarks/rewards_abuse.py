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
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "packages" / "rewards" / "tests"
TOKEN = "benchmark-token-0123456789abcdef"


def load_abuse():
    spec = importlib.util.spec_from_file_location("abuse", TESTS / "abuse.py")
    module = sys.modules["abuse"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    try:
        rows, watch = abuse.run_all(server.pid, address, TOKEN, args.processes)
    finally:
        server.terminate()
        server.wait(30)
    for row in rows:
        row["health_failures"] = len(row["health_failures"])
        row["normal_failures"] = len(row["normal_failures"])
        print(json.dumps(row))
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
