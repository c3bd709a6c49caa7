"""Fixtures for the ferrule-rewards tests: servers on loopback (in this process or as
`rlhf-rewards serve` subprocesses), the test reward functions, and TLS certificates made at
run time."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from ferrule_rewards.functions import FunctionScorer
from ferrule_rewards.server import BackgroundServer
from ferrule_testkit.certs import Certs, make_certs

TESTS = Path(__file__).resolve().parent


def _spec(name: str) -> str:
    return f"{TESTS / 'reward_fns.py'}:{name}"


@pytest.fixture
def fn_spec():
    """fn_spec(name) -> the `path:function` spec of a function in tests/reward_fns.py."""
    return _spec


@pytest.fixture
def tests_dir() -> Path:
    return TESTS


@pytest.fixture
def serve():
    """serve(function_name, **server_options) -> a BackgroundServer on a free loopback port,
    drained at the end of the test. `timeout` goes to the scorer."""
    servers = []

    def start(name: str = "length", *, timeout: float = 5.0, **options):
        scorer = partial(FunctionScorer.load, _spec(name), timeout=timeout)
        servers.append(BackgroundServer(scorer, **options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop(grace=0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def free_port():
    """free_port() -> a loopback port that nothing listens on right now."""
    return _free_port


@dataclass
class ServerProcess:
    process: subprocess.Popen
    address: str = ""
    log: list[str] = field(default_factory=list)  # its stderr lines
    reader: threading.Thread | None = None  # what appends them

    def wait(self, timeout: float | None = 30) -> int:
        """The exit status, once `log` holds every line the server wrote: the reader gets the
        last ones after the process has exited (a busy machine read "stopped" lines late)."""
        status = self.process.wait(timeout)
        if self.reader is not None:
            self.reader.join(5)  # the pipe ends once every process holding it has exited
        return status

    def refusal(self, within: float = 10):
        """The gRPC code a new call gets once the server stops taking calls. After a signal,
        the calls it takes before it has handled the signal are answered, as they should be
        (a fixed sleep before the one call that must be refused lost that race on a busy
        machine)."""
        from ferrule_rewards.client import RewardClient, RewardError

        deadline = time.monotonic() + within
        while True:
            try:
                with RewardClient(self.address, retry_for=0) as client:
                    client.score([{"response": "0"}])
            except RewardError as error:
                return error.code
            assert time.monotonic() < deadline, f"new calls still answered after {within} s"
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, wait: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait(wait)


@pytest.fixture
def spawn():
    """spawn(*args, env=None, ready=True) -> ServerProcess running `python -m ferrule_rewards
    serve ARGS` (the `rlhf-rewards serve` entry point), on a free loopback port unless ARGS
    have --bind. With ready=True it waits for the
    "serving ... on ADDRESS" line; otherwise for the process to exit. Killed at the end."""
    processes = []

    def start(*args: str, env: dict | None = None, ready: bool = True, timeout: float = 60):
        command = [sys.executable, "-m", "ferrule_rewards", "serve", *args]
        if "--bind" not in args:
            command += ["--bind", "127.0.0.1:0"]
        process = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        server = ServerProcess(process)
        processes.append(server)
        serving = threading.Event()

        def read():  # keep draining stderr, so that the server never blocks on a full pipe
            for line in process.stderr:
                server.log.append(line)
                if " serving " in line and not server.address:
                    server.address = line.split(" on ")[1].split()[0]
                    serving.set()
            serving.set()

        server.reader = threading.Thread(target=read, daemon=True)
        server.reader.start()
        if ready:
            assert serving.wait(timeout) and server.address, f"no address: {server.log}"
        else:
            server.wait(timeout)
        return server

    yield start
    for server in processes:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    """A CA, a server certificate for 127.0.0.1 / localhost, and client certificates."""
    return make_certs(tmp_path_factory.mktemp("certs"))
