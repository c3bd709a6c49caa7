"""What a well-behaved client sees while a server is attacked: the scaffolding both servers' abuse
suites share (the reward server's `abuse.py`, the rollout server's `rollout_abuse.py`).

    watch = Watch(server_pid, health=check, normal=call, health_every=0.05, normal_every=0.1)
    rows = run_attacks(watch, ATTACKS, address, token, after=server_is_idle_again)  # stops it

`health` and `normal` are the suite's own calls (gRPC stubs of its service): each returns None
when the server answered as it should, or a line saying what went wrong. Linux only (/proc).
"""

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

Check = Callable[[], str | None]


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (those alive as /proc is read)."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        with contextlib.suppress(OSError):  # it may be gone meanwhile (ENOENT or ESRCH)
            for task in Path(f"/proc/{current}/task").glob("*/children"):
                with contextlib.suppress(OSError):
                    todo += [int(child) for child in task.read_text().split()]
    return pids


def rss(pid: int) -> int:
    """Resident bytes of `pid` (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError):
        return 0


def cpu_ticks(pid: int) -> int:
    """User and system clock ticks `pid` has used (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def answered(call: Callable[[object], bool], items: Iterable, workers: int) -> tuple[int, int]:
    """`call` on every item from `workers` threads at once: (how many returned True, how many
    were made)."""
    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(call, items))
    return sum(outcomes), len(outcomes)


class Watch:
    """Runs in background threads until `stop()`. It calls `health()` every `health_every`
    seconds; latencies go to `health_ms` and failures to `health_failures`. It calls `normal()`
    every `normal_every` seconds; the durations of successful calls go to `normal_s` (in
    seconds) and failures to `normal_failures`. It also tracks the memory of `server_pid` and
    of its process tree (`peak_server_rss`, `peak_tree_rss`), and every process seen (`seen`)."""

    def __init__(
        self,
        server_pid: int,
        *,
        health: Check,
        normal: Check,
        health_every: float,
        normal_every: float,
        longest_call: float,
    ):
        self.server_pid, self.longest_call = server_pid, longest_call
        self.health_ms: list[float] = []
        self.health_failures: list[str] = []
        self.normal_s: list[float] = []
        self.normal_failures: list[str] = []
        self.peak_server_rss = self.peak_tree_rss = 0
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._every, args=(health_every, health, True), daemon=True),
            threading.Thread(target=self._every, args=(normal_every, normal, False), daemon=True),
            threading.Thread(target=self._memory, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def mark(self) -> tuple[int, int, int, int]:
        """Where each record stands now, to read what happened during one attack."""
        return (
            len(self.health_ms),
            len(self.health_failures),
            len(self.normal_s),
            len(self.normal_failures),
        )

    def _every(self, seconds: float, check: Check, is_health: bool) -> None:
        while not self._stop.wait(seconds):
            started = time.perf_counter()
            failure = check()
            took = time.perf_counter() - started
            if is_health:
                self.health_ms.append(took * 1000)
                if failure:
                    self.health_failures.append(failure)
            elif failure:
                self.normal_failures.append(failure)
            else:
                self.normal_s.append(took)

    def _memory(self) -> None:
        while not self._stop.wait(0.05):
            pids = tree(self.server_pid)
            self.seen.update(pids)
            self.peak_server_rss = max(self.peak_server_rss, rss(self.server_pid))
            self.peak_tree_rss = max(self.peak_tree_rss, sum(map(rss, pids)))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.longest_call + 2)


Attack = Callable[[str, str | None], tuple[int, int]]  # (address, token) -> (answered, sent)


def run_attacks(
    watch: Watch,
    attacks: Iterable[Attack],
    address: str,
    token: str | None,
    after: Callable[[Attack, dict], None],
    settle: float = 0.5,
) -> list[dict]:
    """Run each attack in turn while `watch` runs, after letting `watch` run alone for
    `settle` seconds; then call `watch.stop()`. Returns one row per attack: how many of the
    attack's calls were answered, and what the well-behaved client saw meanwhile. Once an
    attack has returned, `after(attack, row)` adds the suite's own figures to the row (is the
    server idle again?). The client's figures are read after `after` returns, so they include
    its wait."""
    rows = []
    try:
        time.sleep(settle)
        for attack in attacks:
            health_at, health_failed_at, normal_at, normal_failed_at = watch.mark()
            started = time.monotonic()
            answered_calls, sent = attack(address, token)
            row = {
                "attack": attack.__name__,
                "answered": answered_calls,
                "sent": sent,
                "seconds": round(time.monotonic() - started, 2),
            }
            after(attack, row)
            health = watch.health_ms[health_at:]
            normal = watch.normal_s[normal_at:]
            row.update(
                health_ms_p50=round(percentile(health, 50), 1),
                health_ms_p99=round(percentile(health, 99), 1),
                health_ms_max=round(max(health, default=0), 1),
                health_failures=watch.health_failures[health_failed_at:],
                normal_calls=len(normal),
                normal_s_max=round(max(normal, default=0), 3),
                normal_failures=watch.normal_failures[normal_failed_at:],
            )
            rows.append(row)
    finally:
        watch.stop()
    return rows
