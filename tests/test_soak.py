"""Soak: the tiny example for 150 steps with a rollout engine, the reward server and the
launcher each killed once, at random steps, then `--resume`. At the end no step is missing or
repeated, no sample was scored twice (but those the killed reward server was scoring when it
died, which its successor scored again), every engine holds the final policy version, and no
process of either launch is left. About two minutes on 2 cores."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_launcher_e2e import command, metrics, wait_for

pytestmark = pytest.mark.soak
STEPS = 150
REWARD = Path(__file__).with_name("soak_reward.py")
OVERRIDES = [
    f"loop.steps={STEPS}",
    "rollout.prompts_per_step=16",  # the example's 32 halved: the same run, twice as many steps
    "output.checkpoint_every=25",
    f'rewards.function="{REWARD}:logged_char_match"',
]


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def session(sid: int) -> list[str]:
    """Processes of session `sid` (each launch runs in a session of its own), as ps lines."""
    rows = subprocess.run(
        ["ps", "-eo", "pid=,sid=,etime=,args="], capture_output=True, text=True, check=True
    ).stdout
    return [row for row in rows.splitlines() if int(row.split()[1]) == sid]


def stopped(sid: int, within: float = 120) -> bool:
    """Whether every process of session `sid` is gone within `within` seconds (Ray's workers
    notice their raylet is gone within about a minute)."""
    deadline = time.monotonic() + within
    while session(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not session(sid)


def kill_at(out: Path, step: int, pid_of, what: str, launcher) -> int:
    """SIGKILL the process `pid_of()` names once the run has logged `step`; its pid."""
    wait_for(lambda: last_step(out) >= step or launcher.poll() is not None, 900, f"step {step}")
    assert launcher.poll() is None, f"the run ended before {what} was killed"
    pid = pid_of()
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.timeout(2400)
def test_150_steps_with_an_engine_the_reward_server_and_the_launcher_killed(tmp_path):
    seed = int(os.environ.get("FERRULE_SOAK_SEED", time.time()))
    rng = random.Random(seed)
    # Both restarts must land in metrics before the checkpoint the resume starts from (75 at
    # the earliest, the launcher dying after it): a reward server killed at step 79 and a
    # launcher at 97 resumed from 75 with the restart in the discarded steps (seed 1795938734).
    engine_at, rewards_at, launcher_at = (
        rng.randint(10, 40),
        rng.randint(50, 70),
        rng.randint(95, 130),  # after at least three checkpoints (every 25 steps)
    )
    where = (
        f"seed {seed}: engine at {engine_at}, rewards at {rewards_at}, launcher at {launcher_at}"
    )
    out, log = tmp_path / "soak", tmp_path / "scored.log"
    env = {**os.environ, "FERRULE_SOAK_LOG": str(log)}
    roles = lambda: json.loads((out / "roles.json").read_text())  # noqa: E731

    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen(
            command(out, *OVERRIDES),
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    try:
        kill_at(out, engine_at, lambda: roles()["rollout-0"]["pid"], "the engine", first)
        killed_rewards = kill_at(
            out, rewards_at, lambda: roles()["rewards"]["pid"], "rewards", first
        )
        kill_at(out, launcher_at, lambda: first.pid, "the launcher", first)
        first.wait(30)
        # Everything the launch started dies with it: Ray, its actors, the reward server.
        assert stopped(first.pid), (where, session(first.pid))
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    first_err = (tmp_path / "first.err").read_text()
    assert "replaced by a new actor" in first_err, first_err[-3000:]
    assert f"reward server (pid {killed_rewards}) was killed by SIGKILL; restarted" in first_err
    saved = json.loads((out / "checkpoint" / "launcher.json").read_text())["step"]

    with open(tmp_path / "second.err", "w") as err:
        second = subprocess.Popen(
            command(out, *OVERRIDES, resume=True),
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    try:
        second.wait(1500)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    second_err = (tmp_path / "second.err").read_text()
    assert second.returncode == 0, f"{where}\n{second_err[-4000:]}"
    assert stopped(second.pid), session(second.pid)
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), (
        where
    )  # none missing or repeated
    kept = [r for r in records if r["step"] <= saved]  # the first launch's, up to its checkpoint
    assert max(r["rollout/restarts"] for r in kept) == 1, where
    assert max(r["rewards/restarts"] for r in kept) == 1, where
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == saved
    assert summary["weights_digest"]["engine_versions"] == [STEPS]  # every engine is in step

    # Each sample is scored once; only those the killed server had in hand when it died (and
    # whose scores never came back) were scored again, by its successor.
    scorers = defaultdict(list)
    for line in log.read_text().splitlines():
        pid, sample = line.split()
        scorers[sample].append(int(pid))
    twice = {s: pids for s, pids in scorers.items() if len(pids) > 1}
    wrong = {s: p for s, p in twice.items() if len(p) != 2 or p[0] != killed_rewards}
    assert not wrong, (where, f"killed reward server {killed_rewards}", wrong)
    assert len(twice) <= 16 * 8, where  # one step's batch at most
    launches = {sample.split("/")[0] for sample in scorers}
    assert len(launches) == 2, launches
