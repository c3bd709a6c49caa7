"""A run's reward service: start a ferrule-rewards server (or use given addresses) and score.

    service = RewardService.start(config.rewards, config.ray, out)   # started and checked
    scored = service.score(prompts, responses, labels)    # rewards and failures, retries inside
    service.stop()

A reward function ([rewards] function) is served by ferrule-rewards' own CLI in a child process
that dies with the launcher (Linux parent-death signal), so even a `kill -9` of the launcher
leaves no reward server behind. The server listens on a free loopback port and writes its
address to out/rewards.address once it serves. A reward model ([rewards] model) is served in a
Ray role of its own, on its own device (reward_model_role.py). Either way the log goes to
out/rewards.log (for the role, only when it runs on the driver's node). A started server that
dies is started again, and the call that found it dead is sent to the new server, up to
[rewards] max_restarts times in restart_window seconds (metric rewards/restarts). Failures are
RunErrors that say which server failed and why.
"""

import ctypes
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ferrule_launcher.calls import RestartBudget, RunError
from ferrule_launcher.config import RayConfig, RewardsConfig

# The parent-death signal fires when the *thread* that started the child ends, not the
# process: a server restarted from the async loop's producer thread would die with that thread.
# So every server is started from this one thread, which lives as long as the launcher.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="rewards-spawner")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Scored:
    rewards: list[float]  # a failed sample's reward is 0.0
    failed: Counter = field(default_factory=Counter)  # failure kind (a Status value) -> count
    first_errors: dict[str, str] = field(default_factory=dict)  # kind -> first error message

    @property
    def failed_fraction(self) -> float:
        return sum(self.failed.values()) / max(len(self.rewards), 1)


class RewardService:
    """The run's reward server: either the servers given in [rewards] address, or a server
    this service started and restarts when it dies (at most [rewards] max_restarts times in
    restart_window seconds)."""

    def __init__(self, config: RewardsConfig, ray_config: RayConfig, out: Path, server=None):
        """`server`: the server this run started (ServerProcess or RewardModelRole), or None to
        use the servers at [rewards] address."""
        self.config, self.ray_config, self.out = config, ray_config, out
        self.server = server
        self.addresses = list(config.address) if server is None else [server.address]
        self.timeout, self.retry_for = config.timeout, config.retry_for
        self.name = (
            f"the reward server at {', '.join(self.addresses)}"
            if server is None
            else config.function or str(config.model)
        )
        self.client = self._client()
        self.kinds_reported: set[str] = set()
        self.budget = RestartBudget(config.max_restarts, config.restart_window)

    def _client(self):
        from ferrule_rewards.client import RewardClient

        token = self.server.token if self.server is not None else None
        return RewardClient(
            self.addresses,
            token=token,
            timeout=self.timeout,
            retry_for=self.retry_for,
            backoff=0.2,
        )

    @classmethod
    def start(cls, config: RewardsConfig, ray_config: RayConfig, out: Path) -> "RewardService":
        """Start the service and check it with one call, so that an unreachable server stops
        the run before the heavy roles start."""
        server = None if config.address else _start_server(config, ray_config, out, first=True)
        service = cls(config, ray_config, out, server)
        try:
            service.score([""], [""], ["0"])  # a function that rejects this sample is fine
        except BaseException:
            service.stop()
            raise
        return service

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        labels: list[str],
        metadata: list[dict[str, str]] | None = None,
    ) -> Scored:
        """One reward per response; a sample the function failed on scores 0.0 and is counted
        by kind. A server that cannot be reached after every retry raises RunError."""
        from ferrule_rewards.client import RewardError

        metadata = metadata or [{}] * len(prompts)
        samples = [
            {"prompt": p, "response": r, "label": a, "metadata": m}
            for p, r, a, m in zip(prompts, responses, labels, metadata, strict=True)
        ]
        if self._died():  # restart now rather than wait out the client's retries
            self._restart()
        try:
            results = self.client.score(samples)
        except RewardError as err:
            if not self._died():
                raise RunError(
                    f"reward server {', '.join(self.addresses)} failed after retries: {err}"
                ) from None
            self._restart()
            try:  # the new server scores what the dead server never returned
                results = self.client.score(samples)
            except RewardError as again:
                raise RunError(f"the restarted reward server failed too: {again}") from None
        scored = Scored([r.reward if r.ok else 0.0 for r in results])
        for result in results:
            if not result.ok:
                scored.failed[str(result.status)] += 1
                scored.first_errors.setdefault(str(result.status), result.error)
        return scored

    @property
    def restarts(self) -> int:
        """Restarts so far (metric rewards/restarts)."""
        return self.budget.total

    def _died(self) -> bool:
        """Whether this run started the server and it has exited."""
        return self.server is not None and self.server.dead()

    def _restart(self) -> None:
        """Start a new server in place of the dead one, unless it died too often already."""
        config, died = self.config, self.server
        how = f"{died.describe()} {died.how_it_ended()}"
        if not self.budget.spend():
            raise RunError(
                f"{how}, after {self.budget.recent} "
                f"restart(s) in the last {config.restart_window:g} s ([rewards] max_restarts = "
                f"{config.max_restarts}, restart_window = {config.restart_window:g}); its log: "
                f"{self.out / 'rewards.log'}"
            )
        died.stop()
        self.server = _start_server(config, self.ray_config, self.out, first=False)
        self.client.close()
        self.addresses = [self.server.address]
        self.client = self._client()
        print(
            f"{how}; restarted as {self.server.describe()} on "
            f"{self.server.address} (restart {self.budget.recent} of at most "
            f"{config.max_restarts} in {config.restart_window:g} s; metric rewards/restarts)",
            file=sys.stderr,
            flush=True,
        )

    def report_new_failures(self, scored: Scored) -> None:
        """Print the first error of each kind of failure once per run (the counts go to the
        metrics every step)."""
        for kind, message in scored.first_errors.items():
            if kind not in self.kinds_reported:
                self.kinds_reported.add(kind)
                print(
                    f"reward function {self.name}: a sample failed ({kind}): {message} "
                    "(scored 0.0; counted in reward/failed; further failures of this kind are "
                    "counted, not printed)",
                    file=sys.stderr,
                    flush=True,
                )

    def where(self) -> dict | None:
        """Where the server this run started is running (for roles.json); None for given
        servers."""
        return None if self.server is None else self.server.where()

    def stop(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.stop()


class ServerProcess:
    """A reward function's server: `rlhf-rewards serve` in a child process of the launcher."""

    token = None  # loopback only

    def __init__(self, process: subprocess.Popen, address: str):
        self.process, self.address = process, address

    def describe(self) -> str:
        return f"the reward server (pid {self.process.pid})"

    def dead(self) -> bool:
        return self.process.poll() is not None

    def how_it_ended(self) -> str:
        return _exit_status(self.process.returncode)

    def where(self) -> dict:
        return {"pid": self.process.pid, "address": self.address}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _start_server(config: RewardsConfig, ray_config: RayConfig, out: Path, first: bool):
    """Start a reward model's Ray role or a reward function's server process, and return it
    once it serves."""
    if config.model is not None:
        from ferrule_launcher.reward_model_role import RewardModelRole

        return RewardModelRole.start(config, ray_config, out, first)
    return _spawn(config, out, first)


def _spawn(config: RewardsConfig, out: Path, first: bool) -> ServerProcess:
    """Start `rlhf-rewards serve` on a free loopback port, and return the server once it
    serves. Its log goes to out/rewards.log (a restart appends to it)."""
    log_path, address_file = out / "rewards.log", out / "rewards.address"
    command = [
        sys.executable,
        "-m",
        "ferrule_rewards",
        "serve",
        "--function",
        config.function,
        "--bind",
        "127.0.0.1:0",
        "--grace",
        "2",
        "--address-file",
        str(address_file),
    ]
    address_file.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # the child keeps its own copy of the log's descriptor
    with open(log_path, "w" if first else "a") as log:
        start = partial(
            subprocess.Popen,
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        process = _SPAWNER.submit(start).result()
    deadline = time.monotonic() + config.start_timeout
    while time.monotonic() < deadline:
        if address_file.exists():
            return ServerProcess(process, address_file.read_text().strip())
        if process.poll() is not None:
            raise RunError(
                f"[rewards] the reward server {_exit_status(process.returncode)}: "
                f"{log_path.read_text().strip()[-2000:]}"
            )
        time.sleep(0.1)
    process.kill()
    raise RunError(
        f"[rewards] the reward server did not start within {config.start_timeout:g} s "
        f"(start_timeout); its log: {log_path}"
    )


def _exit_status(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
