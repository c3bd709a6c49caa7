"""Fixtures for the ferrule-rewards tests: servers on loopback (in this process or as
`rlhf-rewards serve` subprocesses), the test reward functions, and TLS certificates made at
run time."""

import datetime
import ipaddress
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

    def stop(self, sig=signal.SIGTERM, wait: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(wait)


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

        threading.Thread(target=read, daemon=True).start()
        if ready:
            assert serving.wait(timeout) and server.address, f"no address: {server.log}"
        else:
            process.wait(timeout)
            time.sleep(0.1)  # let the reader take the last lines
        return server

    yield start
    for server in processes:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate signed by another CA
    rogue_key: Path


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    """A CA, a server certificate for 127.0.0.1 / localhost, and client certificates."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = tmp_path_factory.mktemp("certs")
    now = datetime.datetime.now(datetime.UTC)

    def write(name: str, key, cert) -> tuple[Path, Path]:
        cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_path, key_path

    def issue(name, issuer_key, issuer_name, *, ca=False, usage=None, sans=()):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return key, builder.sign(issuer_key or key, hashes.SHA256())

    ca_key, ca_cert = issue("ferrule test CA", None, None, ca=True)
    server_key, server_cert = issue(
        "localhost",
        ca_key,
        ca_cert.subject,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_key, client_cert = issue(
        "trainer", ca_key, ca_cert.subject, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    rogue_ca_key, rogue_ca = issue("rogue CA", None, None, ca=True)
    rogue_key, rogue_cert = issue(
        "intruder", rogue_ca_key, rogue_ca.subject, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    ca_path, _ = write("ca", ca_key, ca_cert)
    return Certs(
        ca_path,
        *write("server", server_key, server_cert),
        *write("client", client_key, client_cert),
        *write("rogue", rogue_key, rogue_cert),
    )
