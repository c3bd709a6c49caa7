"""Reward functions for the tests, loaded by path (`reward_fns.py:name`) in and out of process."""

import asyncio
import math
import os
import re
import time
from pathlib import Path

from ferrule_rewards.records import Sample


def length(response: str) -> float:
    return float(len(response))


def misbehaving(response: str) -> float:
    """Does what the response says: raise, nan, inf, hang (3 s, or hang<seconds>), gil (a
    regular expression that holds the GIL for hours), text...;
    otherwise returns the response's length."""
    if response == "raise":
        raise ValueError("asked to raise")
    if response == "nan":
        return math.nan
    if response == "inf":
        return math.inf
    if response == "huge":  # an int no float holds: float() raises OverflowError
        return 10**400
    if response == "gil":  # catastrophic backtracking: C code that never lets go of the GIL
        re.match(r"(a|aa)*c", "a" * 60)
    if response.startswith("hang"):
        time.sleep(float(response[4:] or 3))  # ends after the test, so that processes can exit
    if response == "text":
        return "not a number"
    if response == "no-reward-key":
        return {"score": 1.0}
    if response == "nan-sub-score":
        return {"reward": 1.0, "part": math.nan}
    return float(len(response))


def every_field(prompt, response, prompt_token_ids, response_token_ids, label, metadata):
    return {
        "reward": float(len(prompt) + len(response)),
        "tokens": float(sum(prompt_token_ids) + sum(response_token_ids)),
        "has_label": float(bool(label)),
        "metadata_keys": float(len(metadata)),
    }


def keyword_only(*, response: str, label: str = "") -> float:
    return float(response == label)


async def async_length(response: str) -> float:
    await asyncio.sleep(0.01)
    if response == "hang":
        await asyncio.sleep(60)
    if response == "raise":
        raise RuntimeError("async raise")
    return float(len(response))


def batch_lengths(samples: list[Sample]) -> list:
    return [ValueError("bad") if s.response == "raise" else float(len(s.response)) for s in samples]


def batch_wrong_length(samples: list[Sample]) -> list[float]:
    return [1.0]


async def async_batch(samples: list[Sample]) -> list[float]:
    await asyncio.sleep(0.01)
    return [float(len(s.response)) for s in samples]


# Locks bind to the event loop of their first contended wait, as aiohttp sessions and client
# pools bind to theirs: a second batch on another loop fails with "bound to a different loop".
_row_lock, _batch_lock = asyncio.Lock(), asyncio.Lock()


async def locked_length(response: str) -> float:
    async with _row_lock:
        await asyncio.sleep(0.001)
    return float(len(response))


async def locked_batch(samples: list[Sample]) -> list[float]:
    async def one(sample):
        async with _batch_lock:
            await asyncio.sleep(0.001)
        return float(len(sample.response))

    return list(await asyncio.gather(*map(one, samples)))


def slow(response: str) -> float:
    time.sleep(float(response or 0.5))
    return 1.0


def record_id(response: str, metadata: dict[str, str]) -> float:
    """Appends the sample's id to $REWARDS_TEST_LOG (one line per scored sample), returns id * 2."""
    with open(os.environ["REWARDS_TEST_LOG"], "a") as log:
        log.write(metadata["id"] + "\n")
    time.sleep(0.0005)  # enough work per sample that a kill lands mid-batch
    return 2.0 * int(metadata["id"])


def pid(response: str) -> dict[str, float]:
    """Reward 1.0, with the ids of the process that scored it and of its server (which worker
    it was) as sub-scores; sleeps `response` seconds when that is a number, after appending the pid to
    $REWARDS_TEST_LOG if that is set (a line per sample being scored)."""
    if "REWARDS_TEST_LOG" in os.environ:
        with open(os.environ["REWARDS_TEST_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")
    if response:
        time.sleep(float(response))
    # The scoring process's parent reaps its orphans (child.py); the server is above it.
    reaper = Path(f"/proc/{os.getppid()}/stat").read_text()
    server = int(reaper.rsplit(")", 1)[1].split()[1])
    return {"reward": 1.0, "pid": float(os.getpid()), "server": float(server)}


def hostile(response: str, label: str, metadata: dict[str, str]) -> dict[str, float]:
    """The built-in math_reward (reading the metadata, as a real function may), except for
    `@gil` (C code that holds the GIL for hours), `@spin` (5 s of pure Python work), `@flood`
    (20 MiB to stdout and to stderr), `@fork` (children that try to outlive it: see spawner,
    then a hang), `@subs` (100,000 sub-scores), `@huge` (a reward no float holds), `@crash`
    (SIGKILL to itself), `@orphans` (50 background processes left behind), `@deep` (a reward
    nested 200,000 deep) and `@exit` (sys.exit(3)). With
    metadata "log" (a file), it first appends metadata "id" there: a side effect."""
    from ferrule_rewards.builtin import math_reward

    if "log" in metadata:
        with open(metadata["log"], "a") as log:
            log.write(metadata["id"] + "\n")
    if response == "@flood":
        flood("20")
    if response == "@fork":
        os.environ["REWARDS_TEST_LOG"] = metadata["pids"]
        spawner("fork setsid daemon hang")
    if response == "@subs":
        # ~100x the default limit (1024). A million took ~1 s to build on the 2-core machine,
        # the abuse suite's whole per-sample timeout: the sample could time out instead.
        return {"reward": 1.0} | {f"s{i}": 1.0 for i in range(100_000)}
    if response == "@huge":
        return 10**400
    if response == "@thousand":
        return {"reward": 1.0} | {f"s{i}": 1.0 for i in range(1000)}
    if response == "@crash":
        os.kill(os.getpid(), 9)
    if response == "@orphans":
        orphaner("50")
    if response == "@deep":
        deep = []
        for _ in range(200_000):
            deep = [deep]
        return deep
    if response == "@exit":
        raise SystemExit(3)
    if response == "@gil":
        re.match(r"(a|aa)*c", "a" * 60)
    if response == "@spin":
        stop = time.monotonic() + 5
        while time.monotonic() < stop:
            pass
    return math_reward(response, label or "0") | {"metadata": float(len(metadata))}


def spawner(response: str) -> float:
    """Starts children that try to outlive it, appends their pids to $REWARDS_TEST_LOG, then
    hangs (`hang` in `response`) or returns 1.0: `fork` (os.fork), `setsid` (a Popen in a new
    session) and `daemon` (a double fork through setsid whose middle process exits)."""
    import subprocess
    import sys

    def record(pid: int) -> None:
        with open(os.environ["REWARDS_TEST_LOG"], "a") as log:
            log.write(f"{pid}\n")

    if "fork" in response:
        pid = os.fork()
        if pid == 0:
            while True:  # burns CPU until killed
                pass
        record(pid)
    if "setsid" in response:
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        record(subprocess.Popen(sleeper, start_new_session=True).pid)
    if "daemon" in response:
        read, write = os.pipe()
        if os.fork() == 0:
            os.setsid()
            pid = os.fork()
            if pid == 0:
                time.sleep(600)
                os._exit(0)
            os.write(write, f"{pid}".encode())
            os._exit(0)
        record(int(os.read(read, 32)))
    if "hang" in response:
        time.sleep(600)
    return 1.0


def orphaner(response: str) -> float:
    """Starts shells that leave a background `sleep` behind (an orphan): one, or `response`
    of them; returns 1.0."""
    import subprocess

    for _ in range(int(response or 1)):
        subprocess.run(["sh", "-c", "sleep 0.01 &"], check=True)
    return 1.0


def flood(response: str) -> float:
    """Writes `response` MiB to stdout and as many to stderr, in lines of 1 KiB; returns 1.0."""
    import sys

    line = "x" * 1023 + "\n"
    for _ in range(int(response or 0) * 1024):
        sys.stdout.write(line)
        sys.stderr.write(line)
    sys.stdout.flush()
    return 1.0


def sub_scores(response: str) -> dict[str, float]:
    """Reward 1.0 with `response` sub-scores (named s0, s1...)."""
    return {"reward": 1.0} | {f"s{i}": float(i) for i in range(int(response or 0))}


def once(response: str, metadata: dict[str, str]) -> float:
    """Appends the sample's id to $REWARDS_TEST_LOG (a side effect that must happen once per
    sample), then returns id * 2; `crash` then kills its own process, `gil` holds the GIL for
    hours (the watchdog kills it)."""
    import signal

    with open(os.environ["REWARDS_TEST_LOG"], "a") as log:
        log.write(metadata["id"] + "\n")
    if response == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "gil":
        re.match(r"(a|aa)*c", "a" * 60)
    return 2.0 * int(metadata["id"])


class _FloatRaises:
    def __float__(self):
        raise RuntimeError("no float today")


def batch_bad_outputs(samples: list[Sample]) -> list:
    """For `deep`, a list nested 200,000 deep; for `float`, an object whose __float__ raises;
    for `subs`, a dict whose sub-score's __float__ raises; 1.0 for the others."""
    outputs = []
    for sample in samples:
        if sample.response == "deep":
            deep = []
            for _ in range(200_000):
                deep = [deep]
            outputs.append(deep)
        elif sample.response == "float":
            outputs.append(_FloatRaises())
        elif sample.response == "subs":
            outputs.append({"reward": 1.0, "bad": _FloatRaises()})
        else:
            outputs.append(1.0)
    return outputs


def exits(response: str) -> float:
    """`sys.exit` calls sys.exit(3), `os._exit` calls os._exit(3); 1.0 otherwise."""
    import sys

    if response == "sys.exit":
        sys.exit(3)
    if response == "os._exit":
        os._exit(3)
    return 1.0
