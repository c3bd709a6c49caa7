"""Reward serving throughput: ferrule-rewards (gRPC) against FastAPI + uvicorn (HTTP/JSON).

    uv run python benchmarks/rewards_rps.py [--seconds 3] [--rounds 5] [--clients P] [--workers W]

Every server runs the same trivial rule reward (`trivial_reward` below) in its own processes on
loopback. The baseline serves rewards the way OpenRLHF's `serve_rm.py` does: a FastAPI POST
handler that reads the JSON lists `query`, `prompts`, `labels` and answers `{"rewards": [...]}`,
run by `uvicorn.run(app)` in one process, here without per-request logging.

The headline is the load of RLHF, where many rollout workers score at once: P client processes
(`--clients`, default 3/4 of the cpus, at least 2) each loop Score calls of 256 samples, one at
a time, for the length of a round (`--seconds`), and `ours` / `baseline` are the samples per
second all of them got together, from `rlhf-rewards serve --workers W` (`--workers`, default
half the cpus, at least 1) through RewardClient, and from the baseline through one kept-alive
http.client connection per client process. `ratio` is ours / baseline; `goal` is the ratio the
project aims for. On 64 cpus the defaults are 48 clients and 32 workers, the headline's
configuration in benchmarks/RESULTS.md.

For context: `ours_without_per_peer_bound` is ours with `--max-connections-per-peer 0`, which
gRPC serves directly, without the relay that bounds each peer's connections (the price of that
bound); `baseline_uvicorn_workers` is the baseline run with uvicorn's `workers=W`, the same
W as ours, so that the ratio can be read per core too. The `*_one_in_flight` figures are this
process alone, one call in flight: ours (the W-worker server; a call is served by one worker
either way), the baseline through http.client, `baseline_httpx` through httpx (persistent
client), and `openrlhf_as_shipped`, the server with OpenRLHF's logging (uvicorn access log and
the whole reply per request, to /dev/null here) called with a new connection per call, as
OpenRLHF's `requests.post` client does; `latency_ms_batch1` is p50/p99 at batch 1 (`--latency-calls`
calls). Rounds (`--rounds`) alternate between the measurements so that load from other
processes hits all alike; each figure is the median round. Last line: one JSON object.
"""

import argparse
import contextlib
import http.client
import json
import logging
import multiprocessing
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


def make_app(as_shipped: bool = False):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
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

    return app


def baseline_server(port: int, as_shipped: bool, workers: int) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    # Keep idle connections for the whole run: rounds of the other servers come in between.
    options = {"host": "127.0.0.1", "port": port, "timeout_keep_alive": 600}
    options["log_level"] = "info" if as_shipped else "warning"
    if workers == 1:
        uvicorn.run(make_app(as_shipped), **options)  # as OpenRLHF's serve_rm.py does
    else:  # uvicorn starts workers from an import string
        app_dir = str(HERE.parent)
        uvicorn.run(
            f"{HERE.stem}:make_app", factory=True, app_dir=app_dir, workers=workers, **options
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ours(workers: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start our server on a free port; return the process and its address."""
    command = [sys.executable, "-m", "ferrule_rewards", "serve", "--bind", "127.0.0.1:0"]
    command += ["--function", f"{HERE}:trivial_reward", "--workers", str(workers), *extra]
    # It logs one line when it serves, and nothing per call after that.
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if " serving " in line:
            return process, line.split(" on ")[1].split()[0]
    raise SystemExit(f"{command} exited before it served ({process.wait()})")


def start_baseline(port: int, as_shipped: bool = False, workers: int = 1) -> subprocess.Popen:
    command = [sys.executable, str(HERE), "--baseline-server", str(port), "--workers", str(workers)]
    command += ["--as-shipped"] if as_shipped else []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"the baseline server did not listen on port {port} within a minute")


def post(connection: http.client.HTTPConnection, samples: list[dict]) -> list[float]:
    headers = {"Content-Type": "application/json"}
    connection.request("POST", "/get_reward", json.dumps(openrlhf_body(samples)), headers)
    response = connection.getresponse()
    assert response.status == 200, response.status
    return json.loads(response.read())["rewards"]


def make_caller(target: tuple[str, str]):
    """call(samples) -> rewards, for ("ours", address) or ("http", port); kept-alive."""
    kind, where = target
    if kind == "ours":
        from ferrule_rewards.client import RewardClient

        client = RewardClient(where, batch_size=BATCH)
        return lambda samples: [result.reward for result in client.score(samples)]
    connection = http.client.HTTPConnection("127.0.0.1", int(where), timeout=60)
    return lambda samples: post(connection, samples)


def throughput(call, samples: list[dict], seconds: float) -> float:
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        rewards = call(samples)
        assert len(rewards) == len(samples) and rewards[0] == 1.0, rewards[:3]
        done += len(samples)
    return done / (time.perf_counter() - started)


def client_process(pipe) -> None:
    """One of the P client processes: on ("round", target, seconds, start_at), score batches
    from start_at (time.monotonic, one clock for all processes) for `seconds`, one call at a
    time, and answer (samples scored, when the last call returned)."""
    callers, samples = {}, make_samples(BATCH)
    while (command := pipe.recv()) is not None:
        _, target, seconds, start_at = command
        if target not in callers:
            callers[target] = make_caller(target)
        call, done = callers[target], 0
        time.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < start_at + seconds:
            rewards = call(samples)
            assert len(rewards) == BATCH and rewards[0] == 1.0, rewards[:3]
            done += BATCH
        pipe.send((done, time.monotonic()))


def concurrent(pipes: list, target: tuple[str, str], seconds: float) -> float:
    """Samples/s that all client processes got together from `target` in one round."""
    start_at = time.monotonic() + 0.1
    for pipe in pipes:
        pipe.send(("round", target, seconds, start_at))
    answers = [pipe.recv() for pipe in pipes]
    return sum(done for done, _ in answers) / (max(end for _, end in answers) - start_at)


def latencies(call, samples: list[dict], n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call(samples)
        times.append(time.perf_counter() - started)
    times.sort()
    return times[n // 2] * 1e3, times[int(n * 0.99)] * 1e3


def main() -> None:
    cpus = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per measurement")
    parser.add_argument(
        "--clients", type=int, default=max(2, cpus * 3 // 4), help="client processes"
    )
    parser.add_argument("--workers", type=int, default=max(1, cpus // 2), help="server processes")
    parser.add_argument("--latency-calls", type=int, default=1000)
    parser.add_argument("--baseline-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--as-shipped", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        return baseline_server(args.baseline_server, args.as_shipped, args.workers)

    import httpx

    ours_process, address = start_ours(args.workers)
    # The per-peer bound's relay (front.py) costs a hop: the same server without it, for scale.
    bare_process, bare_address = start_ours(args.workers, "--max-connections-per-peer", "0")
    port, workers_port, shipped_port = free_port(), free_port(), free_port()
    processes = [
        ours_process,
        bare_process,
        start_baseline(port),
        start_baseline(workers_port, workers=args.workers),
        start_baseline(shipped_port, as_shipped=True),
    ]
    context = multiprocessing.get_context("spawn")  # no fork of a process that runs gRPC
    pipes, clients = [], []
    for _ in range(args.clients):
        pipe, child_end = context.Pipe()
        clients.append(context.Process(target=client_process, args=(child_end,)))
        clients[-1].start()
        pipes.append(pipe)
    ours = make_caller(("ours", address))
    baseline = make_caller(("http", str(port)))
    session = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

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

    targets = {
        "ours": ("ours", address),
        "ours_without_per_peer_bound": ("ours", bare_address),
        "baseline": ("http", str(port)),
        "baseline_uvicorn_workers": ("http", str(workers_port)),
    }
    callers = {
        "ours_one_in_flight": ours,
        "baseline_one_in_flight": baseline,
        "baseline_httpx_one_in_flight": baseline_httpx,
        "openrlhf_as_shipped_one_in_flight": openrlhf_as_shipped,
    }
    try:
        batch, single = make_samples(BATCH), make_samples(1)
        for target in targets.values():  # warm up connections and code paths
            concurrent(pipes, target, 0.5)
        for call in callers.values():
            throughput(call, batch, 0.5)
        rounds = {name: [] for name in [*targets, *callers]}
        for _ in range(args.rounds):
            for name, target in targets.items():
                rounds[name].append(concurrent(pipes, target, args.seconds))
            for name, call in callers.items():
                rounds[name].append(throughput(call, batch, args.seconds))
        rps = {name: statistics.median(values) for name, values in rounds.items()}
        ours_p50, ours_p99 = latencies(ours, single, args.latency_calls)
        base_p50, base_p99 = latencies(baseline, single, args.latency_calls)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):  # a client that died has said why already
                pipe.send(None)
        for client in clients:
            client.join(10)
        session.close()
        for process in processes:
            process.terminate()
            process.wait(30)
    per_round = {name: [round(v) for v in values] for name, values in rounds.items()}
    print(f"samples/s at batch {BATCH}, per round: {json.dumps(per_round)}", file=sys.stderr)
    figures = {name: round(value) for name, value in rps.items()}
    print(
        json.dumps(
            {
                "name": "rewards_rps",
                "unit": f"samples/s, trivial rule reward, batch {BATCH}, "
                f"{args.clients} client processes at once",
                "ours": figures.pop("ours"),
                "baseline": figures.pop("baseline"),
                "ratio": round(rps["ours"] / rps["baseline"], 2),
                "goal": GOAL,
                "clients": args.clients,
                "workers": args.workers,
                **figures,
                "ratio_one_in_flight": round(
                    rps["ours_one_in_flight"] / rps["baseline_one_in_flight"], 2
                ),
                "latency_ms_batch1": {
                    "ours_p50": round(ours_p50, 3),
                    "ours_p99": round(ours_p99, 3),
                    "baseline_p50": round(base_p50, 3),
                    "baseline_p99": round(base_p99, 3),
                },
                "cpus": cpus,
            }
        )
    )


if __name__ == "__main__":
    main()
