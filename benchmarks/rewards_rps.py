"""Reward serving throughput: ferrule-rewards (gRPC) against FastAPI + uvicorn (HTTP/JSON).

    uv run python benchmarks/rewards_rps.py [--seconds 3] [--rounds 5]

Both servers run the same trivial rule reward (`trivial_reward` below) in their own process on
loopback; this process is the client for both. The baseline serves rewards the way OpenRLHF's
`serve_rm.py` does (a FastAPI POST handler that reads JSON lists `query`, `prompts`, `labels`
and answers `{"rewards": [...]}`), minus its per-request logging, and is called through one
persistent httpx connection (OpenRLHF's client opens a new connection per call). Rounds
alternate between the two so that load from other processes hits both alike; the figure is
the median round. Last line: one JSON object with samples/s at batch 256 (`ours`,
`baseline`, `ratio`) and p50/p99 latency at batch 1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH = 256
GOAL = 3.0
HERE = Path(__file__).resolve()


def trivial_reward(response: str, label: str) -> float:
    return 1.0 if label and response.endswith(label) else 0.0


def make_samples(n: int) -> list[dict]:
    return [
        {
            "prompt": f"Question {i}: what is {i} + {i}? Think step by step.",
            "response": f"Adding {i} to itself gives {2 * i}. The answer is {2 * i}",
            "label": str(2 * i),
        }
        for i in range(n)
    ]


def baseline_server(port: int) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/get_reward")
    async def get_reward(request: Request):
        data = await request.json()
        queries, labels = data["query"], data["labels"]
        rewards = [trivial_reward(q, label) for q, label in zip(queries, labels, strict=True)]
        return JSONResponse({"rewards": rewards})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def start_ours() -> tuple[subprocess.Popen, str]:
    """Start our server on a free port; return the process and its address."""
    command = [sys.executable, "-m", "ferrule_rewards", "serve", "--bind", "127.0.0.1:0"]
    command += ["--function", f"{HERE}:trivial_reward"]
    # It logs one line when it serves, and nothing per call after that.
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if " serving " in line:
            return process, line.split(" on ")[1].split()[0]
    raise SystemExit(f"{command} exited before it served ({process.wait()})")


def start_baseline(port: int) -> subprocess.Popen:
    import socket

    process = subprocess.Popen([sys.executable, str(HERE), "--baseline-server", str(port)])
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"the baseline server did not listen on port {port} within a minute")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def throughput(call, samples: list[dict], seconds: float) -> float:
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        rewards = call(samples)
        assert len(rewards) == len(samples) and rewards[0] == 1.0, rewards[:3]
        done += len(samples)
    return done / (time.perf_counter() - started)


def latencies(call, samples: list[dict], n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call(samples)
        times.append(time.perf_counter() - started)
    times.sort()
    return times[n // 2] * 1e3, times[int(n * 0.99)] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per server")
    parser.add_argument("--latency-calls", type=int, default=1000)
    parser.add_argument("--baseline-server", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        return baseline_server(args.baseline_server)

    import httpx

    from ferrule_rewards.client import RewardClient

    ours_process, address = start_ours()
    port = free_port()
    base_process = start_baseline(port)
    client = RewardClient(address, batch_size=BATCH)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def ours(samples):
        return [result.reward for result in client.score(samples)]

    def baseline(samples):
        body = {
            "query": [s["response"] for s in samples],
            "prompts": [s["prompt"] for s in samples],
            "labels": [s["label"] for s in samples],
        }
        response = http.post("/get_reward", json=body)
        response.raise_for_status()
        return response.json()["rewards"]

    try:
        batch, single = make_samples(BATCH), make_samples(1)
        for call in (ours, baseline):  # warm up connections and code paths
            throughput(call, batch, 0.5)
        rounds = {"ours": [], "baseline": []}
        for _ in range(args.rounds):
            rounds["ours"].append(throughput(ours, batch, args.seconds))
            rounds["baseline"].append(throughput(baseline, batch, args.seconds))
        ours_rps, base_rps = (statistics.median(rounds[k]) for k in ("ours", "baseline"))
        ours_p50, ours_p99 = latencies(ours, single, args.latency_calls)
        base_p50, base_p99 = latencies(baseline, single, args.latency_calls)
    finally:
        client.close()
        http.close()
        for process in (ours_process, base_process):
            process.terminate()
            process.wait(10)
    print(f"samples/s at batch {BATCH}, per round: {json.dumps(rounds)}", file=sys.stderr)
    print(
        json.dumps(
            {
                "name": "rewards_rps",
                "unit": f"samples/s, trivial rule reward, batch {BATCH}",
                "ours": round(ours_rps),
                "baseline": round(base_rps),
                "ratio": round(ours_rps / base_rps, 2),
                "goal": GOAL,
                "latency_ms_batch1": {
                    "ours_p50": round(ours_p50, 3),
                    "ours_p99": round(ours_p99, 3),
                    "baseline_p50": round(base_p50, 3),
                    "baseline_p99": round(base_p99, 3),
                },
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
