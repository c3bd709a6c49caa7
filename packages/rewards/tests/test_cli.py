"""`rlhf-rewards serve` and `score` as subprocesses: startup errors, SIGTERM draining, and two
replicas with one killed under load."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from ferrule_rewards.client import RewardClient, RewardError


def test_serve_and_score_from_the_command_line(spawn):
    server = spawn("--function", "ferrule_rewards.builtin:math_reward")
    lines = [
        {"response": "<think>2+2</think> The answer is 4", "label": "4"},
        {"response": "5", "label": "4"},
        {"response": "#### 4"},
    ]
    score = [sys.executable, "-m", "ferrule_rewards", "score", server.address]
    stdin = "\n".join(json.dumps(line) for line in lines)
    done = subprocess.run(score, input=stdin, capture_output=True, text=True, timeout=60)
    # a sample failed: every line is printed, and the status says so (it was 0)
    assert done.returncode == 1, done.stderr
    assert "rlhf-rewards score: 1 of 3 samples failed" in done.stderr
    allowed = [*score, "--allow-failed"]
    kept = subprocess.run(allowed, input=stdin, capture_output=True, text=True, timeout=60)
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert kept.returncode == 0, kept.stderr
    assert [json.loads(line) for line in kept.stdout.splitlines()] == results
    assert results[0] == {
        "reward": 1.1,
        "status": "ok",
        "sub_scores": {"accuracy": 1.0, "format": 1.0},
    }
    assert results[1]["reward"] == 0.0
    assert results[2]["status"] == "error" and "reference answer" in results[2]["error"]
    health = [sys.executable, "-m", "ferrule_rewards", "health", server.address]
    done = subprocess.run(health, capture_output=True, text=True, timeout=60)
    assert (done.returncode, json.loads(done.stdout)) == (0, {server.address: "SERVING"})
    assert server.stop() == 0
    done = subprocess.run([*health, "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "UNREACHABLE" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bind", "0.0.0.0:0"], "refusing to listen on 0.0.0.0:0"),
        (["--function", "nowhere:f"], "cannot import 'nowhere'"),
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--model", "/no/such/model"], "no config.json"),
        (["--bind", "localhost"], "expected host:port"),
        # Each of these started a server that refused everything, removed a limit, or ended
        # in a traceback.
        (["--max-concurrency", "0"], "argument --max-concurrency: 0 is out of range: must be >= 1"),
        (["--max-batch", "0"], "argument --max-batch: 0 is out of range"),
        (["--max-message-mb", "0"], "argument --max-message-mb: 0 is out of range: must be > 0"),
        (["--max-message-mb", "-1"], "argument --max-message-mb: -1 is out of range"),
        (["--max-message-mb", "4096"], "4096 is out of range: must be > 0 and <= 1024"),
        (["--grace", "nan"], "argument --grace: nan is out of range: must be >= 0"),
        (["--grace", "-5"], "argument --grace: -5 is out of range"),
        (["--timeout", "inf"], "argument --timeout: inf is out of range: must be > 0"),
        (["--call-timeout", "0"], "argument --call-timeout: 0 is out of range"),
        (["--processes", "0"], "argument --processes: 0 is out of range"),
        # it forked until killed
        (["--processes", "100000"], "100000 is out of range: must be >= 1 and <= 256"),
        (["--workers", "100000"], "argument --workers: 100000 is out of range"),
        (["--max-log-mb", "-1"], "argument --max-log-mb: -1 is out of range: must be >= 0"),
        (["--max-log-mb", "2048"], "2048 is out of range: must be >= 0 and <= 1024"),
        (["--max-sub-scores", "-1"], "argument --max-sub-scores: -1 is out of range"),
        (["--max-sub-scores", "2000000"], "2000000 is out of range: must be >= 0 and <= 1e+06"),
        (["--max-batch", "many"], "argument --max-batch: 'many' is not a int"),
        (
            ["--max-message-mb", "0.0001", "--max-batch", "100000000"],
            "raise --max-message-mb to 3433 or more, or lower --max-batch",
        ),
        (["--max-stuck", "1"], "unrecognized arguments: --max-stuck"),
        (
            ["--bind", "0.0.0.0:0", "--tls-cert", "c.pem", "--tls-key", "k.pem"],
            "TLS alone lets any client in",
        ),
    ],
)
def test_bad_arguments_exit_2_and_say_why(spawn, args, message):
    if "--function" not in args and "--model" not in args:
        args = ["--function", "ferrule_rewards.builtin:exact_match", *args]
    server = spawn(*args, env={"FERRULE_REWARDS_TOKEN": ""}, ready=False)
    assert server.process.returncode == 2
    assert message in "".join(server.log), server.log


@pytest.mark.parametrize("form", ["module", "file"])
@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def score(response:\n", "{file}:1: SyntaxError: "),
        ("1 / 0\n", "importing it raised {file}:1: ZeroDivisionError: division by zero"),
        ("import nosuchdep\n", "importing it raised {file}:1: ModuleNotFoundError"),
    ],
)
def test_a_broken_reward_module_is_one_line_and_exit_2(spawn, tmp_path, form, source, message):
    # A SyntaxError (or any error raised while importing) was a scoring process's traceback
    # and exit 1; a missing dependency read as if the module itself were missing.
    (tmp_path / "broken_rewards.py").write_text(source)
    spec = "broken_rewards:score" if form == "module" else f"{tmp_path}/broken_rewards.py:score"
    server = spawn("--function", spec, env={"PYTHONPATH": str(tmp_path)}, ready=False)
    log = "".join(server.log)
    assert server.process.returncode == 2, log
    assert "Traceback" not in log and len(log.strip().splitlines()) == 1, log
    assert f"reward function {spec!r}: " in log
    assert message.format(file=tmp_path / "broken_rewards.py") in log


def test_model_without_the_model_extra_names_the_extra():
    # torch missing made a scoring process die with a raw `No module named 'torch'` traceback
    hide = "import sys; sys.modules['torch'] = None; from ferrule_rewards.cli import main; main()"
    command = [sys.executable, "-c", hide, "serve", "--model", "/no/such/model"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "rlhf-rewards serve: error: --model needs the [model] extra (torch not installed): "
        "install 'ferrule-rewards[model]' (in a clone: pip install './packages/rewards[model]')\n"
    )


@pytest.mark.e2e  # ~5-10 s of subprocesses (the fast tier stays under 10 minutes)
def test_score_against_no_server_fails_within_the_connect_timeout_naming_the_address():
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "ferrule_rewards", "score", address]
    started = time.monotonic()
    done = subprocess.run(command, input='{"response": "4"}', capture_output=True, text=True)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert f"{address}: UNAVAILABLE" in done.stderr and "--connect-timeout" in done.stderr
    assert took < 15, took  # 29 s before: the client's retry_for of 30 s
    short = subprocess.run(
        [*command, "--connect-timeout", "0.5"], input="{}", capture_output=True, text=True
    )
    assert short.returncode == 2 and "and 0.5s" in short.stderr, short.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_taken_port_is_an_error_not_a_shared_port(spawn):
    first = spawn("--function", "ferrule_rewards.builtin:exact_match")
    second = spawn(
        "--function", "ferrule_rewards.builtin:exact_match", "--bind", first.address, ready=False
    )
    assert second.process.returncode == 2
    assert f"cannot listen on {first.address}" in "".join(second.log)


def test_a_token_lets_it_listen_beyond_loopback(spawn, tmp_path):
    """Bound to every interface (on a free port), reached here through loopback."""
    token = tmp_path / "token"
    token.write_text("t" * 32)
    server = spawn(
        "--function", "ferrule_rewards.builtin:exact_match",
        "--bind", "0.0.0.0:0", "--token-file", str(token),
    )  # fmt: skip
    port = server.address.rsplit(":", 1)[1]
    assert any("clear text" in line for line in server.log)  # warned: a token without TLS
    with RewardClient(f"127.0.0.1:{port}", token="t" * 32) as client:
        assert client.score([{"response": "#### 4", "label": "4"}])[0].reward == 1.0
    with RewardClient(f"127.0.0.1:{port}", token=None) as client, pytest.raises(RewardError):
        client.score([{"response": "#### 4", "label": "4"}])


def test_sigterm_drains(spawn, fn_spec):
    server = spawn("--function", fn_spec("slow"), "--grace", "10")
    outcome = {}

    def in_flight():
        with RewardClient(server.address) as client:
            outcome["results"] = client.score([{"response": "1.5"}])

    caller = threading.Thread(target=in_flight)
    caller.start()
    time.sleep(0.5)  # the call is being scored
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.refusal() == grpc.StatusCode.UNAVAILABLE  # new calls are refused
    caller.join()
    assert outcome["results"][0].reward == 1.0  # the call in flight finished
    assert server.wait(10) == 0
    assert time.monotonic() - started < 5
    assert any("draining: 1 call(s) in progress" in line for line in server.log)


def test_a_drain_cut_short_by_the_grace_period_exits_1_and_says_so(spawn, fn_spec):
    """It logged CancelledError tracebacks and exited 0, as if every call had finished."""
    server = spawn("--function", fn_spec("slow"), "--grace", "0.5")
    outcome = {}

    def in_flight():
        try:
            # no retries for 30 s (the default): the server is gone for good
            RewardClient(server.address, retry_for=1).score([{"response": "20"}])
        except RewardError as error:
            outcome["error"] = error

    caller = threading.Thread(target=in_flight)
    caller.start()
    time.sleep(0.5)  # the call is being scored
    server.process.send_signal(signal.SIGTERM)
    assert server.wait(10) == 1
    caller.join()
    assert "error" in outcome  # the client was told: its call did not finish
    log = "".join(server.log)
    assert "the grace period (0.5s) ended with 1 call(s) in flight" in log
    assert "Traceback" not in log


def test_the_docker_health_check_works_with_tls_when_told_how(spawn, certs):
    """The image's HEALTHCHECK spoke plaintext: it failed as soon as TLS was on. It now takes
    FERRULE_REWARDS_HEALTH_ARGS. Runs the Dockerfile's own command."""
    dockerfile = (Path(__file__).parents[1] / "deploy" / "Dockerfile").read_text()
    command = re.search(r"HEALTHCHECK[^\n]*\\\n\s*CMD (.*)", dockerfile)[1]
    server = spawn(
        "--function", "ferrule_rewards.builtin:exact_match", "--tls-cert", str(certs.server_cert),
        "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca),
    )  # fmt: skip
    port = server.address.rsplit(":", 1)[1]
    command = command.replace("rlhf-rewards", f"{sys.executable} -m ferrule_rewards")
    command = command.replace("127.0.0.1:50051", f"127.0.0.1:{port}")
    told = (
        f"--tls-ca {certs.ca} --tls-cert {certs.client_cert} --tls-key {certs.client_key} "
        "--tls-server-name localhost"
    )
    for args, status in (("", 1), (told, 0)):
        env = {**os.environ, "FERRULE_REWARDS_HEALTH_ARGS": args}
        done = subprocess.run(command, shell=True, env=env, capture_output=True, timeout=60)
        assert done.returncode == status, done
    assert server.stop() == 0


@pytest.mark.e2e  # ~8 s: server processes of their own
def test_two_replicas_one_killed_under_load(spawn, fn_spec, tmp_path):
    """The client fails over when a replica dies mid-call: every sample gets exactly one
    result, with the right value; the survivor never scores a sample twice; the only samples
    scored twice are ones whose call died with the killed replica."""
    logs = [tmp_path / "replica0.log", tmp_path / "replica1.log"]
    replicas = [
        spawn("--function", fn_spec("record_id"), env={"REWARDS_TEST_LOG": str(log)})
        for log in logs
    ]
    batches, batch_size, in_flight = 40, 256, 4
    results, errors = [], []

    def load():
        with RewardClient(
            [r.address for r in replicas], batch_size=32, max_in_flight=in_flight
        ) as client:
            for batch in range(batches):
                ids = range(batch * batch_size, (batch + 1) * batch_size)
                try:
                    scored = client.score(
                        [{"response": "", "metadata": {"id": str(i)}} for i in ids]
                    )
                except RewardError as error:
                    errors.append(error)
                    return
                results.append((list(ids), [r.reward for r in scored]))

    loader = threading.Thread(target=load)
    loader.start()
    while len(results) < batches // 4:
        time.sleep(0.01)
    replicas[0].process.kill()
    loader.join(120)
    assert not errors and len(results) == batches
    for ids, rewards in results:
        assert rewards == [2.0 * i for i in ids]  # one result each, in order, the right one
    survivor = Counter(logs[1].read_text().split())
    killed = Counter(logs[0].read_text().split())
    assert max(survivor.values()) == 1  # the survivor scored no sample twice
    assert max(killed.values()) == 1
    assert set(survivor) | set(killed) == {str(i) for i in range(batches * batch_size)}
    twice = set(survivor) & set(killed)
    # At most the chunks in flight on the killed replica when it died: retried elsewhere.
    assert len(twice) <= in_flight * 32, len(twice)
    print(f"{len(twice)} samples were scored by the killed replica and again by the survivor")
    assert replicas[0].process.wait() == -signal.SIGKILL
    os.kill(replicas[1].process.pid, signal.SIGTERM)
    assert replicas[1].wait(10) == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_address_file_names_where_it_serves_once_it_serves(spawn, tmp_path, workers):
    """A program that starts the server on port 0 learns the port from a file, not a log."""
    path = tmp_path / "address"
    server = spawn(
        "--function",
        "ferrule_rewards.builtin:math_reward",
        "--workers",
        workers,
        "--address-file",
        str(path),
    )
    assert path.read_text() == server.address + "\n"  # written by the time it logs "serving"
    assert not server.address.endswith(":0")
    with RewardClient(path.read_text().strip()) as client:
        assert client.score([{"response": "#### 4", "label": "4"}])[0].ok
    assert server.stop() == 0


def test_sighup_drains_and_the_functions_children_die(spawn, fn_spec, tmp_path):
    """SIGHUP (a closed terminal, a log rotation) exited 129 with no log line, the call in
    flight got UNAVAILABLE, and the function's forked children lived on under PID 1. Now it
    drains as SIGTERM does."""
    log = tmp_path / "pids"
    server = spawn("--function", fn_spec("spawner"), "--grace", "10",
                   env={"REWARDS_TEST_LOG": str(log)})  # fmt: skip
    with RewardClient(server.address) as client:
        assert client.score([{"response": "setsid"}])[0].reward == 1.0
    child = int(log.read_text().split()[0])
    server.process.send_signal(signal.SIGHUP)
    assert server.wait(10) == 0
    assert any("draining" in line for line in server.log)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists():
        assert time.monotonic() < deadline, f"the function's child {child} outlived the server"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"response": "x", "label": }', "stdin line 3: not JSON: Expecting value: line 1 column"),
        ('{"response": "x", "label": 4}', "stdin line 3: field 'label' (4): "),
        ("[1, 2]", "stdin line 3: a list, not a dict"),
    ],
)
def test_score_names_the_line_and_the_field_of_a_bad_sample(bad, message):
    """A bad JSON line was reported by its column only (`line 1 column 28`), and a sample
    with `"label": 4` as `bad argument type for built-in operation`, without the field. Now
    the message names the line of stdin (blank lines counted) and the field."""
    stdin = '{"response": "a"}\n\n' + bad + "\n"
    score = [sys.executable, "-m", "ferrule_rewards", "score", "127.0.0.1:1"]
    done = subprocess.run(score, input=stdin, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
