"""End to end: the real `rlhf-launch` on the tiny example, shortened (real Ray, vLLM, DeepSpeed,
reward server and weight sync on CPU). Each run takes about a minute on 2 cores, mostly start-up.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrule_weightsync.ipc import SEGMENTS, orphaned_segments

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny.toml"
# Shortened: 16 steps at a higher learning rate than the example, no evaluation until the end.
SHORT = [
    "loop.steps=16",
    "trainer.learning_rate=5e-4",
    "loop.eval_every=0",
    "output.progress=false",
    "output.tensorboard=true",
]
# For runs whose subject is not the engine: the transformers engine is ready ~8 s sooner than
# vLLM on 2 cores (vLLM's imports, ~11 s of CPU, are a launch's longest start-up path) and
# generates the tiny model's tokens ~3x faster. vLLM runs in every test of what it does: the
# example as shipped, async weight syncs, partial rollouts, two engines beside ZeRO-3 ranks,
# LoRA, rollout correction, an engine replaced, Ctrl-C, and the soak.
TRANSFORMERS = 'rollout.backend="transformers"'


def command(out: Path, *overrides: str, resume: bool = False) -> list[str]:
    args = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for item in [*SHORT, f'output.dir="{out}"', *overrides]:
        args += ["--set", item]
    return [*args, "--resume"] if resume else args


def launch(out: Path, *overrides: str, resume: bool = False, timeout: float = 420):
    result = subprocess.run(
        command(out, *overrides, resume=resume), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def start(out: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """A launch in the background, its output captured (read it with communicate())."""
    return subprocess.Popen(
        command(out, *overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_reward_rises(records: list[dict]) -> None:
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.03, f"reward did not rise: {rewards}"


def _segments() -> set[str]:
    return {path.name for path in SEGMENTS.glob("ferrule-ws-*")}


def test_sync_run_learns_and_writes_every_output(tmp_path):
    out = tmp_path / "sync"
    before = _segments()
    result = launch(out)
    # the weight sync's shared memory went with the run (its senders closed before the kill)
    # (only those no living process holds: another run's, on the other CI worker, are held)
    assert not list(orphaned_segments(SEGMENTS / name for name in _segments() - before))
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 17))
    assert all(r["staleness"] == 0 for r in records)  # sync: every sample from the last version
    assert_reward_rises(records)
    for key in ("time/generate", "time/score", "time/train", "time/sync", "tokens_per_s"):
        assert records[0][key] > 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "steps", "wall_seconds"):
        assert key in summary and f"{key} = " in result.stdout
    assert summary["steps"] == 16
    # the start-up timeline: each phase's seconds add up to its total; each role's readiness
    startup = summary["startup_seconds"]
    phases = [startup[k] for k in ("ray", "reward server", "roles", "evaluation")]
    assert all(t > 0 for t in phases) and sum(phases) == pytest.approx(startup["total"], abs=0.05)
    assert set(startup["roles_ready"]) == {"policy rank 0", "reference", "rollout engine 0"}
    assert max(startup["roles_ready"].values()) <= startup["roles"] + 0.05
    # printed as each role became ready, whichever was first (a busy machine reorders them)
    line = next(line for line in result.stdout.splitlines() if line.startswith("start-up "))
    listed = re.search(r"\(ready at: ([^)]*)\)", line).group(1).split(", ")
    printed = {role: float(t) for role, t in (entry.rsplit(" ", 1) for entry in listed)}
    assert printed.keys() == startup["roles_ready"].keys()
    assert list(printed.values()) == sorted(printed.values())
    # where each role's own start went, on a line of its own under the start-up line
    phases = startup["role_phases"]
    assert phases.keys() == printed.keys()
    trainer = ["process", "imports", "distributed", "weights", "deepspeed"]
    assert list(phases["policy rank 0"]) == list(phases["reference"]) == trainer
    assert list(phases["rollout engine 0"])[:2] == ["process", "imports"]
    lines = result.stdout.splitlines()
    for role, seconds in phases.items():
        assert sum(seconds.values()) == pytest.approx(startup["roles_ready"][role], abs=0.5)
        spent = ", ".join(f"{phase} {t:.1f}" for phase, t in seconds.items())
        assert f"  {role}: {spent} s" in lines
    # the held-out evaluation: 4 samples per prompt scored by the run's reward (char_match),
    # pass@k over exact answers (reward 1.0), the task's own greedy exact-match accuracy, and
    # what its generation cost: 100 prompts x 4 samples + 100 greedy, at most 6 tokens each
    generation = {"tokens", "seconds", "tokens_per_s", "response_length", "truncated"}
    generation = {f"generation/{key}" for key in generation} | {"generation/response_length/max"}
    for report in (summary["eval_before"], summary["eval_after"]):
        assert (
            set(report) == {"reward", "pass@1", "pass@4", "reward_failed", "accuracy"} | generation
        )
        assert 0 < report["pass@1"] <= report["pass@4"] <= 1 and report["reward_failed"] == 0
        assert 0 < report["generation/tokens"] <= 500 * 6
        assert report["generation/response_length"] == report["generation/tokens"] / 500
        assert 0 < report["generation/response_length/max"] <= 6
        assert 0 <= report["generation/truncated"] <= 1 and report["generation/seconds"] > 0
    assert re.search(r"before RL: .*; \d+ tokens in [\d.]+ s, longest \d, \d+% cut", result.stdout)
    assert summary["eval_after"]["reward"] > summary["eval_before"]["reward"]
    assert records[-1]["eval/reward"] == summary["eval_after"]["reward"]
    assert records[-1]["time/eval"] > 0 and "time/eval" not in records[0]  # only where it ran
    assert "held-out after RL:  reward" in result.stdout
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert (out / "policy" / "config.json").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_async_run_learns_with_bounded_staleness_on_separate_placements(tmp_path):
    out = tmp_path / "async"
    launch(
        out,
        'loop.mode="async"',
        "loop.partial_rollout=true",  # weight syncs freeze running samples, which then go on
        "loop.max_staleness=1",
        'ray.placement="separate"',
        "ray.cpus_per_role=0.4",
    )
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 17))
    assert max(r["staleness"] for r in records) <= 1
    assert any(r["staleness"] > 0 for r in records)  # generation really ran ahead
    # Whether a sync lands while samples run is timing; the share of those that did is logged.
    assert all(0 <= r["rollout/mixed_version_samples"] <= 1 for r in records)
    assert_reward_rises(records)
    roles = json.loads((out / "roles.json").read_text())
    assert roles["policy-0"]["pid"] != roles["rollout-0"]["pid"]


def test_colocated_two_zero3_policy_ranks_reference_two_engines_and_jsonl_prompts(tmp_path):
    """Two ZeRO-3 policy ranks on prompts of mixed lengths in small token budgets: the ranks'
    micro-batch counts differ from step to step (before 5229fd7 the run hung in the first
    step's training), and every step's weights still reach both engines."""
    from ferrule_launcher.task import eval_problems, step_problems

    held_out = eval_problems("reversal", 3, 20, seed=0)
    train = step_problems("reversal", 3, 64, 0, 1, held_out)
    # every third prompt much longer: each rank's share of a step differs in its tokens
    train = [
        ("Now a new string. " * 4 + p if i % 3 == 0 else p, a) for i, (p, a) in enumerate(train)
    ]
    for name, rows in [("eval", held_out), ("train", train)]:
        lines = [json.dumps({"question": p, "answer": a}) for p, a in rows]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines))
    out = tmp_path / "colocate"
    launch(
        out,
        'ray.placement="colocate"',
        "trainer.ranks=2",
        "trainer.zero_stage=3",  # exported by all-gathers on both ranks, sent by rank 0
        # a budget of a few rows: ranks whose rows differ in length get different numbers of
        # micro-batches, and ZeRO-3's every forward is a collective (they must keep in step)
        "trainer.micro_batch_tokens=128",
        "rollout.engines=2",
        "trainer.kl_coef=0.01",
        "loop.steps=4",
        "ray.cpus_per_role=0.5",
        'task.name="data"',
        f'task.sources=[{{path="{tmp_path / "train.jsonl"}", eval_path="{tmp_path / "eval.jsonl"}", '
        'prompt_key="question", label_key="answer"}]',
    )
    records = metrics(out)
    assert len(records) == 4 and all("kl" in r for r in records)
    assert records[-1]["eval/pass@1"] > 0  # the warm start solves some held-out prompts
    assert "eval/accuracy" not in records[-1]  # exact match is the synthetic tasks' figure only
    roles = json.loads((out / "roles.json").read_text())
    assert {"policy-0", "policy-1", "reference", "rollout-0", "rollout-1"} <= set(roles)
    synced = json.loads((out / "summary.json").read_text())["weights_digest"]
    assert synced["engine_versions"] == [4, 4]  # every step's weights reached both engines


def test_ppo_with_critic_reference_and_an_sft_stage(tmp_path):
    out = tmp_path / "ppo"
    launch(
        out,
        TRANSFORMERS,
        "sft.steps=4",
        'trainer.estimator="gae"',
        "critic.learning_rate=1e-4",
        "trainer.kl_coef=0.05",
        'trainer.kl_in="reward"',
        'trainer.kl_kind="k1"',
        "trainer.epochs=2",
        "trainer.mini_batches=2",
        "loop.steps=3",
    )
    records = metrics(out)
    assert len(records) == 3
    assert all("critic/loss" in r and "kl" in r for r in records)
    assert (out / "sft" / "model" / "config.json").exists()


def wait_for(predicate, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def kill_9_after_a_checkpoint(out: Path, overrides: list[str], step: int) -> int:
    """Launch, and kill -9 the launcher and every process it started once a checkpoint of
    `step` or later is complete; the checkpoint's step."""
    process = subprocess.Popen(
        command(out, *overrides),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoint = out / "checkpoint" / "launcher.json"
    try:
        wait_for(
            lambda: checkpoint.exists() and json.loads(checkpoint.read_text())["step"] >= step,
            300,
            f"a checkpoint of step {step} or later",
        )
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(30)
    return json.loads(checkpoint.read_text())["step"]


def test_kill_9_then_resume_repeats_and_skips_no_step_and_ends_with_the_same_weights(tmp_path):
    """[rollout] exact = true and a fixed seed: a run killed with kill -9 after its checkpoint at
    step 2 and resumed repeats and skips no step, keeps and exports what [output] says, and
    ends with the same weights, bit for bit, as the same run uninterrupted. What must survive
    the kill: the data order, the engines' sampling keys (reseeded for each draw from the seed
    and the step), the optimizer, the KL controller and the reward moments (reward_norm =
    "running" and an adaptive KL coefficient, both carried in the checkpoint)."""
    overrides = [
        'rollout.backend="transformers"',
        "rollout.exact=true",
        "loop.steps=6",
        "output.checkpoint_every=2",
        "output.keep_last=1",
        'output.keep_best="reward"',
        "output.export_every=3",
        "trainer.kl_target=0.01",
        'trainer.reward_norm="running"',
    ]
    whole = tmp_path / "whole"
    launch(whole, *overrides)
    out = tmp_path / "resumed"
    saved = kill_9_after_a_checkpoint(out, overrides, step=2)
    launch(out, *overrides, resume=True)
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["resumed_from_step"] == saved == 2 and resumed["steps"] == 6
    expected = json.loads((whole / "summary.json").read_text())["weights_digest"]
    assert resumed["weights_digest"] == expected
    # and step by step: every step once, the same rewards and losses as without the kill
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))
    after = [(r["reward"], r["train/loss"]) for r in metrics(out)]
    assert after == [(r["reward"], r["train/loss"]) for r in metrics(whole)]
    # retention: the newest complete checkpoint (4) and the one of the best reward, no others
    kept = json.loads((out / "checkpoint" / "launcher.json").read_text())["kept"]
    rewards = {r["step"]: r["reward"] for r in metrics(out)}
    best = max((2, 4), key=lambda step: (rewards[step], step))
    assert [c["step"] for c in kept] == sorted({4, best})
    on_disk = {p.name for p in (out / "checkpoint" / "policy").glob("step*")}
    assert on_disk == {f"step{c['step']}" for c in kept}
    exported = sorted(p.name for p in (out / "exports").iterdir())
    assert exported == ["step3", "step6"] and (out / "exports/step3/config.json").exists()


def test_a_dead_rollout_engine_is_replaced_and_the_run_goes_on(tmp_path):
    out = tmp_path / "engine-restart"
    # Killed as soon as the roles are up: the first evaluation's generate call finds it dead
    # (the soak test's kills, later in a run, mostly land in weight syncs).
    process = start(out, "loop.steps=12", 'loop.mode="async"')
    try:
        wait_for((out / "roles.json").exists, 300, "the roles to start", every=0.05)
        killed = json.loads((out / "roles.json").read_text())["rollout-0"]["pid"]
        os.kill(killed, signal.SIGKILL)
        _, stderr = process.communicate(timeout=400)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    assert "the rollout engine 0" in stderr and "replaced by a new actor" in stderr
    assert "Unhandled error" not in stderr  # the aborted sync's calls were fetched
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    restarts = [r["rollout/restarts"] for r in records]  # a running count: 0s, then 1s
    assert restarts == sorted(restarts) and restarts[-1] == 1, restarts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["weights_digest"]["engine_versions"] == [12]  # the successor is in step
    assert json.loads((out / "roles.json").read_text())["rollout-0"]["pid"] != killed


def test_a_dead_rollout_engine_stops_the_run_naming_it_when_no_restart_is_left(tmp_path):
    out = tmp_path / "dead"
    process = start(out, TRANSFORMERS, "loop.steps=400", "rollout.max_restarts=0")
    roles = out / "roles.json"
    try:
        wait_for(roles.exists, 300, "the roles to start")
        time.sleep(2)
        os.kill(json.loads(roles.read_text())["rollout-0"]["pid"], signal.SIGKILL)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1
    # named with what it was doing when it died: "(weight sync receiver)" during a sync
    assert re.search(r"the rollout engine 0( \([^)]*\))? actor died", stderr), stderr[-3000:]
    assert "[rollout] max_restarts = 0" in stderr, stderr[-3000:]


def test_a_dead_reward_server_is_restarted_and_the_run_goes_on(tmp_path):
    out = tmp_path / "rewards-restart"
    # RAY_ADDRESS names no cluster: the run starts its own ([ray] address is empty), as it
    # would beside a user's `ray start` (joining it, Ray refused the run's num_cpus)
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}
    process = start(out, TRANSFORMERS, "loop.steps=10", env=env)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists(), 300, "the first step")
        os.kill(json.loads((out / "roles.json").read_text())["rewards"]["pid"], signal.SIGKILL)
        _, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-4000:]
    assert "was killed by SIGKILL; restarted as the reward server (pid" in stderr
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 11))
    restarts = [r["rewards/restarts"] for r in records]  # a running count: 0s, then 1s
    assert restarts == sorted(restarts) and restarts[-1] == 1, restarts


def test_unreachable_reward_server_is_retried_then_a_clear_error(tmp_path):
    out = tmp_path / "norewards"
    result = subprocess.run(
        command(
            out, 'rewards.function=""', 'rewards.address=["127.0.0.1:9"]', "rewards.retry_for=2"
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "127.0.0.1:9" in result.stderr and "after retries" in result.stderr


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_every_process_the_run_started(tmp_path):
    out = tmp_path / "interrupt"
    # As from a terminal: a suite started in the background (`cmd &` in a script, nohup) runs
    # with SIGINT ignored, and a child inherits that through exec, so the launcher would never
    # see the signal. A handler of our own is reset to the default in the child instead.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = start(out, "loop.steps=400")
    finally:
        signal.signal(signal.SIGINT, inherited)
    roles = out / "roles.json"
    try:
        wait_for(roles.exists, 300, "the roles to start")
        time.sleep(2)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr[-3000:]
    pids = [role["pid"] for role in json.loads(roles.read_text()).values()]
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, f"processes {pids} to stop")


def test_hybrid_layout_with_the_transformers_engine_on_two_bundles(tmp_path):
    """The GPU path's layout on CPU: colocate_all with two policy ranks and two transformers
    engines (a bundle each, rank i and engine i together), one shared-memory group per rank,
    forward passes in micro-batches, the hybrid switches (no-ops on CPU) in every step; after
    the last sync both engines hold exactly the policy's weights."""
    out = tmp_path / "hybrid"
    launch(
        out,
        'rollout.backend="transformers"',
        "trainer.ranks=2",
        "rollout.engines=2",
        "trainer.zero_stage=2",
        "trainer.forward_batch_size=16",
        "trainer.offload_between_phases=true",
        "rollout.sleep_between_phases=true",
        "loop.steps=4",
        "ray.cpus_per_role=0.5",
    )
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("time/switch" in r for r in records)
    digests = json.loads((out / "summary.json").read_text())["weights_digest"]
    assert digests["engines"] == [digests["policy"]] * 2
    roles = json.loads((out / "roles.json").read_text())
    assert {"policy-0", "policy-1", "rollout-0", "rollout-1"} <= set(roles)


def test_ppo_with_a_two_rank_reference_and_critic_under_zero3(tmp_path):
    """The reference and the critic as data-parallel groups of their own (two ranks each, ZeRO-3
    sharding over them), beside a one-rank policy; checkpoint and resume include the critic's
    ranks."""
    out = tmp_path / "ranks"
    overrides = [
        TRANSFORMERS,
        'trainer.estimator="gae"',
        "critic.learning_rate=1e-4",
        "critic.ranks=2",
        "trainer.kl_coef=0.05",
        'trainer.kl_in="reward"',
        'trainer.kl_kind="k1"',
        "trainer.reference_ranks=2",
        "trainer.zero_stage=3",
        "trainer.mini_batches=2",
        'ray.placement="colocate"',
        "ray.cpus_per_role=0.3",
        "output.checkpoint_every=2",
    ]
    launch(out, *overrides, "loop.steps=3")  # checkpoints after step 2
    launch(out, *overrides, "loop.steps=4", resume=True)  # from it: steps 3 and 4 again
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("critic/loss" in r and "kl" in r for r in records)
    saved = records[1]  # step 2 checkpointed: its seconds by role and part
    for role in ("policy", "critic"):  # the two roles save at once
        parts = [saved[f"time/checkpoint/{role}_{part}"] for part in ("weights", "optimizer")]
        assert min(parts) > 0 and sum(parts) <= saved["time/checkpoint"]
    assert not any(key.startswith("time/checkpoint") for key in records[0])
    roles = json.loads((out / "roles.json").read_text())
    assert {"reference", "reference-1", "critic", "critic-1"} <= set(roles)
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2


# -- issue 16: the trainer's options reachable from the TOML --------------------------------------

FLAKY_REWARD = '''
from ferrule_rewards.builtin import char_match


def flaky(response: str, label: str) -> float:
    """char_match, but raising on about a quarter of the responses (by their characters)."""
    if sum(map(ord, response)) % 4 == 0:
        raise ValueError(f"flaky cannot score {response!r}")
    return char_match(response, label)
'''


def flaky_reward(tmp_path: Path) -> str:
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY_REWARD)
    return f'rewards.function="{path}:flaky"'


def test_rollout_correction_gspo_reward_shaping_adaptive_kl_and_failed_rewards(tmp_path):
    """Through the real loop: TIS with a floor and sequence masking, GSPO's sequence ratio,
    running reward normalisation with a clip, the adaptive KL coefficient, and a reward
    function that fails on some samples; then a resume that restores the driver's state."""
    out = tmp_path / "options"
    options = [
        "loop.steps=3",
        "output.checkpoint_every=2",
        'trainer.rollout_correction="tis"',
        "trainer.tis_cap=1.5",
        "trainer.tis_floor=0.1",
        "trainer.kl_max=5.0",
        "trainer.sequence_mask=[0.5, 2.0]",
        'trainer.ratio_level="sequence"',
        "trainer.clip_low=3e-4",
        "trainer.clip_high=4e-4",
        'trainer.reward_norm="running"',
        "trainer.reward_clip=3.0",
        "trainer.kl_coef=0.01",
        "trainer.kl_target=1e-9",  # at step 1 the policy is the reference: KL 0, below it
        "trainer.kl_horizon=1000",
        flaky_reward(tmp_path),
        "rewards.max_failed_fraction=1.0",
    ]
    result = launch(out, *options)
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 <= r["vllm_kl"] < 0.05, r  # the same float32 weights, other kernels
        assert 0 <= r["rollout_correction/truncated"] <= 1
        assert 0 <= r["rollout_correction/masked_sequences"] <= 1
        assert r["reward/failed"] == r["reward/failed_error"] > 0
    coefs = [r["kl_coef"] for r in records]
    # Step 1 is at the reference (KL 0): -20% x 256 / 1000; then the KL is above target: +20%.
    assert coefs[0] == 0.01 and coefs[1] == pytest.approx(0.01 * (1 - 0.2 * 0.256)), coefs
    assert coefs[2] == pytest.approx(coefs[1] * (1 + 0.2 * 0.256)), coefs
    assert result.stderr.count("a sample failed (error)") == 1, result.stderr[-3000:]
    assert "flaky cannot score" in result.stderr and "flaky.py:flaky" in result.stderr
    state = json.loads((out / "checkpoint" / "launcher.json").read_text())
    assert state["step"] == 2 and state["loop"]["kl_coef"] == coefs[2]
    assert state["loop"]["reward_moments"][0] == 2 * 32 * 8  # every score of steps 1 and 2
    # Resume from step 2: step 3 again, with the restored coefficient (not kl_coef = 0.01).
    launch(out, *options, resume=True)
    again = metrics(out)
    assert [r["step"] for r in again] == [1, 2, 3] and again[2]["kl_coef"] == coefs[2]


def test_lora_icepop_batch_normalisation_dapo_filtering_and_overlong_penalties(tmp_path):
    out = tmp_path / "dapo"
    launch(
        out,
        "loop.steps=2",
        "trainer.lora_rank=4",
        "trainer.lora_alpha=32",
        'trainer.lora_targets=["q_proj", "v_proj", "down_proj"]',
        'trainer.rollout_correction="icepop"',
        "trainer.icepop_low=0.9",
        "trainer.icepop_high=1.1",
        'trainer.reward_norm="batch"',
        "loop.keep_group_mean=[0.3, 0.8]",  # most groups of a warm-started model are outside
        "loop.max_draws=3",
        "trainer.overlong_buffer=3",  # of max_tokens = 6: answers are 3 letters and an EOS
        "trainer.overlong_penalty=0.5",
        "trainer.truncated_score=-1.0",
    )
    records = metrics(out)
    assert len(records) == 2
    for r in records:
        assert 0 <= r["rollout_correction/masked"] < 0.5 and "vllm_kl" in r
        assert r["reward/failed"] == 0
        # the filter drew again while groups were missing, and never more than allowed
        assert 1 <= r["filter/draws"] <= 3 and 0 < r["filter/kept_groups"] <= 32
        assert r["filter/kept_groups"] == 32 or r["filter/draws"] == 3
        assert -0.5 <= r["reward/overlong_penalty"] <= 0
        assert 0 <= r["reward/truncated"] <= 1
        assert 0 < r["response_length"] <= r["response_length/max"]
    assert any(r["filter/draws"] > 1 for r in records), records
    assert any(r["reward/overlong_penalty"] < 0 for r in records), records
    # LoRA: the final policy is saved merged, with its adapter (tests/test_lora_sync.py checks
    # that an engine's log-probabilities after a sync are the merged model's)
    assert (out / "policy" / "config.json").exists()
    assert (out / "policy" / "adapter" / "adapter_config.json").exists()
    assert records[-1]["vllm_kl"] < 0.01  # the engine runs what the trainer has


def test_a_step_with_too_many_failed_rewards_stops_the_run_naming_the_function(tmp_path):
    out = tmp_path / "failing"
    result = subprocess.run(
        command(out, TRANSFORMERS, flaky_reward(tmp_path), "rewards.max_failed_fraction=0.01"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "step 1: reward function" in result.stderr and "flaky.py:flaky" in result.stderr
    assert "[rewards] max_failed_fraction = 0.01" in result.stderr, result.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists() or not metrics(out)


def test_sync_partial_rollouts_continue_cut_samples_across_steps_and_a_resume(tmp_path):
    """Sync mode, transformers engine, [loop] partial_rollout: the kit's random model with 24
    end-of-sequence tokens gives long-tailed lengths (mean ~20, cap 80), so calls are cut; the
    cut samples go through Ray to the engine again and come back whole, with tokens from two
    or three policy versions, within the staleness bound. The checkpoint keeps the groups in
    flight, and a run resumed from it continues them."""
    import shutil

    from ferrule_testkit import tiny_model

    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2"), model)
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = list(range(100, 124))
    (model / "generation_config.json").write_text(json.dumps(generation))
    out = tmp_path / "partial"
    overrides = [
        f'model.path="{model}"',
        'rollout.backend="transformers"',
        "rollout.max_tokens=80",
        "rollout.max_batch_size=64",
        "loop.partial_rollout=true",
        "loop.max_staleness=2",
        "loop.steps=6",
        "task.eval_prompts=8",
        "output.checkpoint_every=5",
    ]
    launch(out, *overrides)
    records = metrics(out)
    saved = json.loads((out / "checkpoint" / "launcher.json").read_text())
    in_flight = saved["loop"]["rollouts"]["unfinished"]
    assert saved["step"] == 5 and len(in_flight) == records[4]["rollout/unfinished_groups"]
    resumed = launch(out, *overrides, resume=True)
    assert "resuming from step 5" in resumed.stdout
    assert [r["step"] for r in metrics(out)][-1] == 6
    assert [r["step"] for r in records] == list(range(1, 7))
    assert any(r["rollout/unfinished_groups"] > 0 for r in records)  # calls were cut
    assert any(r["rollout/mixed_version_samples"] > 0 for r in records[1:])  # and continued
    assert all(r["staleness"] <= 2 and r["dropped_stale_groups"] == 0 for r in records)
    assert all(r["tokens_per_s"] > 0 for r in records)


def test_two_ranks_share_each_sequence_of_the_policy_the_reference_and_the_critic(tmp_path):
    """[trainer] sequence_parallel = 2, PPO: the two ranks of the policy, of the reference
    ("auto") and of the critic each take the same rows, each running its model on half of
    every row's positions; the step counts each response token once
    (packages/trainer/tests/test_sequence_parallel.py checks the numbers against one rank)."""
    out = tmp_path / "sequence-parallel"
    launch(
        out,
        TRANSFORMERS,
        "trainer.ranks=2",
        "trainer.sequence_parallel=2",
        'trainer.estimator="gae"',
        "critic.ranks=2",
        "critic.learning_rate=1e-4",
        'ray.placement="colocate"',
        "ray.cpus_per_role=0.3",
        "loop.steps=3",
    )
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    rows = 32 * 8
    for r in records:
        assert r["train/tokens"] == pytest.approx(r["response_length"] * rows)
        assert r["train/skipped"] == 0 and "kl" in r and "critic/loss" in r
    roles = json.loads((out / "roles.json").read_text())
    assert {"policy-1", "reference-1", "critic-1"} <= set(roles)
