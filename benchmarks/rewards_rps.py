"""Reward serving throughput: ferrule-rewards (gRPC) against FastAPI + uvicorn (HTTP/JSON).

    uv run python benchmarks/rewards_rps.py [--seconds 3] [--rounds 5]

Every server runs the same trivial rule reward (`trivial_reward` below) in its own process on
loopback, one call in flight at a time; this process is the client. The baseline serves
rewards the way OpenRLHF's `serve_rm.py` does (a FastAPI POST handler that reads the JSON
lists `query`, `prompts`, `labels` and answers `{"rewards": [...]}`), without per-request
logging, and is called through the leanest client we have: the standard library's
http.client on one kept-alive connection. `ratio` is ours / that baseline.

For context: `baseline_httpx` is the same server called through httpx (persistent client),
and `openrlhf_as_shipped` is the server with OpenRLHF's logging (uvicorn access log and the
whole reply per request, to /dev/null here) called with a new connection per call, as
OpenRLHF's `requests.post` client does. Rounds alternate between the servers so that load
from other processes hits all alike; each figure is the median round. Last line: one JSON
object with samples/s at batch 256 and p50/p99 latency at batch 1.
"""

import argparse
import http.client
import json
import logging
import os
import socket
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


def openrlhf_body(samples: list[dict]) -> dict:
    """The request OpenRLHF's remote reward client sends: one list per field."""
    return {
        "query": [s["response"] for s in samples],
        "prompts": [s["prompt"] for s in samples],
        "labels": [s["label"] for s in samples],
    }


def baseline_server(port: int, as_shipped: bool) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
    logging.basicConfig(level=logging.INFO)
    logger = logging.getLogger("serve_rm")

    @app.post("/get_reward")
    async def get_reward(request: Request):
        data = await request.json()
        queries, labels = data["query"], data["labels"]
        rewards = [trivial_reward(q, label) for q, label in zip(queries, labels, strict=True)]
        result = {"rewards": rewards}
        if as_shipped:
            logger.info(f"Sent JSON: {result}")
        return JSONResponse(result)

    # Keep idle connections for the whole run: rounds of the other servers come in between.
    log_level = "info" if as_shipped else "warning"
    uvicorn.run(app, host="127.0.0.1", port=port, log_level=log_level, timeout_keep_alive=600)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def start_baseline(port: int, as_shipped: bool) -> subprocess.Popen:
    command = [sys.executable, str(HERE), "--baseline-server", str(port)]
    command += ["--as-shipped"] if as_shipped else []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"the baseline server did not listen on port {port} within a minute")


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
    parser.add_argument("--as-shipped", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        return baseline_server(args.baseline_server, args.as_shipped)

    import httpx

    from ferrule_rewards.client import RewardClient

    ours_process, address = start_ours()
    port, shipped_port = free_port(), free_port()
    processes = [ours_process, start_baseline(port, False), start_baseline(shipped_port, True)]
    client = RewardClient(address, batch_size=BATCH)
    session = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    keep_alive = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def ours(samples):
        return [result.reward for result in client.score(samples)]

    def post(connection: http.client.HTTPConnection, samples: list[dict]) -> list[float]:
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/get_reward", json.dumps(openrlhf_body(samples)), headers)
        response = connection.getresponse()
        assert response.status == 200, response.status
        return json.loads(response.read())["rewards"]

    def baseline(samples):  # the leanest client: the standard library, one kept-alive socket
        return post(keep_alive, samples)

    def baseline_httpx(samples):
        response = session.post("/get_reward", json=openrlhf_body(samples))
        response.raise_for_status()
        return response.json()["rewards"]

    def openrlhf_as_shipped(samples):  # a new connection per call, like requests.post
        connection = http.client.HTTPConnection("127.0.0.1", shipped_port, timeout=60)
        try:
            return post(connection, samples)
        finally:
            connection.close()

    callers = {
        "ours": ours,
        "baseline": baseline,
        "baseline_httpx": baseline_httpx,
        "openrlhf_as_shipped": openrlhf_as_shipped,
    }
    try:
        batch, single = make_samples(BATCH), make_samples(1)
        for call in callers.values():  # warm up connections and code paths
            throughput(call, batch, 0.5)
        rounds = {name: [] for name in callers}
        for _ in range(args.rounds):
            for name, call in callers.items():
                rounds[name].append(throughput(call, batch, args.seconds))
        rps = {name: statistics.median(values) for name, values in rounds.items()}
        ours_p50, ours_p99 = latencies(ours, single, args.latency_calls)
        base_p50, base_p99 = latencies(baseline, single, args.latency_calls)
    finally:
        client.close()
        session.close()
        keep_alive.close()
        for process in processes:
            process.terminate()
            process.wait(10)
    per_round = {name: [round(v) for v in values] for name, values in rounds.items()}
    print(f"samples/s at batch {BATCH}, per round: {json.dumps(per_round)}", file=sys.stderr)
    print(
        json.dumps(
            {
                "name": "rewards_rps",
                "unit": f"samples/s, trivial rule reward, batch {BATCH}, one call in flight",
                "ours": round(rps["ours"]),
                "baseline": round(rps["baseline"]),
                "ratio": round(rps["ours"] / rps["baseline"], 2),
                "goal": GOAL,
                "baseline_httpx": round(rps["baseline_httpx"]),
                "openrlhf_as_shipped": round(rps["openrlhf_as_shipped"]),
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
