"""The launcher's plain pieces, without Ray: tasks, which roles share a placement group, and the
outputs. (The batch layout and the estimators are ferrule-trainer's: its tests/test_rl.py.)"""

import json

import pytest

from ferrule_launcher import calls
from ferrule_launcher.calls import RestartBudget
from ferrule_launcher.placement import Role, groups_for
from ferrule_launcher.task import eval_problems, problem, step_problems


def test_tasks_are_deterministic_and_held_out_prompts_never_train():
    held_out = eval_problems("reversal", 3, 100, seed=0)
    assert len({p for p, _ in held_out}) == 100
    assert held_out == eval_problems("reversal", 3, 100, seed=0)
    step = step_problems("reversal", 3, 64, seed=0, step=5, exclude=held_out)
    assert step == step_problems("reversal", 3, 64, seed=0, step=5, exclude=held_out)
    assert not {p for p, _ in step} & {p for p, _ in held_out}
    prompt, answer = held_out[0]
    assert answer == " " + prompt.split()[-2].rstrip(".")[::-1]
    import random

    assert problem("arithmetic", 2, random.Random(1))[0].startswith("Question: what is")


def test_placement_groups_and_bundles_for_each_mode():
    from ferrule_launcher.placement import bundle_of

    roles = [Role("policy", 0), Role("policy", 1), Role("reference"), Role("critic")]
    roles += [Role("rollout", 0), Role("rollout", 1)]
    assert [r.name for r in roles] == [
        "policy-0",
        "policy-1",
        "reference",
        "critic",
        "rollout-0",
        "rollout-1",
    ]
    assert groups_for("colocate_all", roles) == {"all": roles}
    named = {g: [r.name for r in rs] for g, rs in groups_for("colocate", roles).items()}
    assert named == {
        "policy": ["policy-0", "policy-1", "reference"],
        "critic": ["critic"],
        "rollout": ["rollout-0", "rollout-1"],
    }
    assert len(groups_for("separate", roles)) == 6
    assert [bundle_of("colocate", r) for r in roles] == [0, 1, 0, 0, 0, 1]
    # colocate_all: one group, a bundle per rank / engine index (the hybrid engine: on GPUs,
    # policy rank i and engine i share GPU i); the reference and the critic on bundle 0
    assert [bundle_of("colocate_all", r) for r in roles] == [0, 1, 0, 0, 0, 1]
    from types import SimpleNamespace

    from ferrule_launcher.placement import bundles

    ray = SimpleNamespace(placement="colocate_all")
    plan = {i: [r.name for r in rs] for i, rs in bundles(ray, roles)["all"].items()}
    assert plan == {
        0: ["policy-0", "reference", "critic", "rollout-0"],
        1: ["policy-1", "rollout-1"],
    }
    one = bundles(ray, [Role("policy", 0), Role("rollout", 0)])
    assert list(one["all"]) == [0]  # the CPU example: everything on one bundle, as before


def test_a_cluster_too_small_is_an_error_naming_the_keys_before_anything_starts():
    import pytest

    from ferrule_launcher.calls import RunError
    from ferrule_launcher.config import RayConfig
    from ferrule_launcher.placement import check_fits

    roles = [Role("policy", 0), Role("policy", 1), Role("rollout", 0), Role("rollout", 1)]
    hybrid = RayConfig(placement="colocate_all", gpus_per_role=1, cpus_per_role=1)
    check_fits(hybrid, roles, {"GPU": 2.0, "CPU": 4.0})  # two GPUs, each a rank and an engine
    with pytest.raises(
        RunError, match=r"\[ray\] gpus_per_role: 2 bundles x 1 GPUs = 2, but the Ray cluster has 1"
    ):
        check_fits(hybrid, roles, {"GPU": 1.0, "CPU": 4.0})
    separate = RayConfig(placement="separate", gpus_per_role=1, cpus_per_role=0.5)
    with pytest.raises(RunError, match=r"4 bundles x 1 GPUs = 4, but the Ray cluster has 2"):
        check_fits(separate, roles, {"GPU": 2.0, "CPU": 8.0})
    with pytest.raises(RunError, match=r"\[ray\] cpus_per_role: 4 bundles x 0.5 CPUs = 2"):
        check_fits(separate, roles, {"GPU": 4.0, "CPU": 1.0})
    # a reward model's role asks for its own device, outside the bundles
    check_fits(hybrid, roles, {"GPU": 3.0, "CPU": 4.0}, rewards=(1.0, 1.0))
    with pytest.raises(
        RunError, match=r"2 bundles x 1 GPUs \+ the reward model's 1 \(\[rewards\] gpus\) = 3, but"
    ):
        check_fits(hybrid, roles, {"GPU": 2.0, "CPU": 4.0}, rewards=(1.0, 1.0))


def test_outputs_cut_metrics_back_on_resume_and_plot(tmp_path):
    from ferrule_launcher.outputs import Outputs

    out = Outputs(tmp_path, total_steps=4, first_step=1, tensorboard=False, progress=False)
    for step in (1, 2, 3):
        out.log(step, {"reward": 0.1 * step, "time/generate": 1.0})
    out.close()
    resumed = Outputs(tmp_path, total_steps=4, first_step=3, tensorboard=False, progress=False)
    resumed.log(3, {"reward": 0.3, "eval/accuracy": 0.5})
    resumed.log(4, {"reward": 0.4})
    resumed.finish({"steps": 4})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4]
    assert (tmp_path / "reward_curve.png").exists()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 4}


def test_outputs_show_skipped_steps_and_write_their_inf_norm_as_null(tmp_path, capsys):
    """A skipped update (ferrule-trainer's nonfinite.py) is said in the log with where its
    values arose, counted in the progress line, listed by `skipped_steps` (summary.json's
    "skipped_steps"), also across a resume; its inf gradient norm is written as null."""
    from ferrule_launcher.outputs import Outputs, skipped_steps

    where = "micro-batch 2 of 4: NaN in the gradients of 9 of 26 parameters, ..."
    out = Outputs(tmp_path, total_steps=4, first_step=1, tensorboard=False, progress=False)
    out.log(1, {"reward": 0.1, "train/skipped": 0.0})
    out.log(2, {"train/skipped": 1.0, "train/nonfinite": where, "train/grad_norm": float("inf")})
    out.close()
    resumed = Outputs(tmp_path, total_steps=4, first_step=3, tensorboard=False, progress=False)
    resumed.log(3, {"critic/skipped": 1.0, "critic/nonfinite": ""})
    resumed.log(4, {"train/skipped": 0.0})
    resumed.close()
    err = capsys.readouterr().err
    assert f"step 2: the policy's update was skipped, its gradients not finite: {where}" in err
    assert "step 3: the critic's update was skipped, its gradients not finite: not located" in err
    assert "step 3: " in err and "skipped 2" in err.split("step 4: ")[1]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert records[1]["train/grad_norm"] is None and records[1]["train/nonfinite"] == where
    assert skipped_steps(records) == [2, 3]


def test_role_names_and_labels():
    assert [Role("policy", 1).name, Role("rollout", 0).name] == ["policy-1", "rollout-0"]
    assert [Role("reference").name, Role("reference", 1).name] == ["reference", "reference-1"]
    assert [Role("critic").label, Role("critic", 1).label] == ["critic", "critic rank 1"]
    assert [Role("policy", 0).label, Role("rollout", 2).label] == [
        "policy rank 0",
        "rollout engine 2",
    ]


def test_restart_budget_counts_restarts_within_the_window_only(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(calls.time, "monotonic", lambda: now[0])
    budget = RestartBudget(limit=2, window=600)
    assert budget.spend() and budget.spend()
    assert not budget.spend()  # a third within 600 s
    now[0] += 600.5  # both have left the window
    assert budget.spend() and budget.recent == 1 and budget.total == 3
    assert not RestartBudget(limit=0, window=600).spend()  # 0: the first death stops the run


def test_checkpoint_retention_keeps_the_newest_and_the_best(tmp_path):
    from ferrule_launcher.outputs import drop_checkpoints, retained

    kept = [{"step": s, "value": v} for s, v in [(10, 0.2), (20, 0.7), (30, 0.5), (40, None)]]
    assert [c["step"] for c in retained(kept, keep_last=2)] == [30, 40]
    assert [c["step"] for c in retained(kept, 2, "eval/pass@1")] == [20, 30, 40]
    assert [c["step"] for c in retained(kept, 1, "loss", "min")] == [10, 40]
    ties = [{"step": 10, "value": 0.7}, {"step": 20, "value": 0.7}, {"step": 30, "value": 0.1}]
    assert [c["step"] for c in retained(ties, 1, "m")] == [20, 30]  # the newer of equals
    assert retained([{"step": 5, "value": None}], 1, "m") == [{"step": 5, "value": None}]
    for role in ("policy", "critic"):
        for step in (10, 20):
            (tmp_path / "checkpoint" / role / f"step{step}").mkdir(parents=True)
    drop_checkpoints(tmp_path, [10])
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("checkpoint/*/*"))
    assert left == ["checkpoint/critic/step20", "checkpoint/policy/step20"]


def test_outputs_log_sample_tables_and_weights_and_biases_offline(tmp_path, monkeypatch):
    """Every log gets the metrics and an evaluation's sample table: metrics.jsonl and
    eval_samples.jsonl, TensorBoard (scalars, markdown text), and W&B in offline mode (no
    account, no network); a resumed run cuts both files back to its checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ferrule_launcher.outputs import Outputs

    monkeypatch.setenv("WANDB_API_KEY", "")  # offline must not need one
    rows = [
        {
            "source": "a",
            "prompt": "1 + 1 =",
            "response": " 2 | two\nok",
            "label": "2",
            "reward": 1.0,
        },
        {"source": "b", "prompt": "2 + 2 =", "response": " 5", "label": "4", "reward": 0.0},
    ]
    wandb = {"project": "test", "mode": "offline", "dir": str(tmp_path), "name": "t", "config": {}}
    out = Outputs(tmp_path, 3, 1, tensorboard=True, progress=False, wandb=wandb)
    out.samples(0, rows)
    for step in (1, 2, 3):
        out.log(step, {"reward": 0.1 * step, "eval/pass@1": 0.5})
    out.samples(2, rows[:1])
    out.close()

    logged = [
        json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()
    ]
    assert [(r["step"], r["source"]) for r in logged] == [(0, "a"), (0, "b"), (2, "a")]
    assert logged[0]["response"] == " 2 | two\nok" and logged[1]["reward"] == 0.0
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([0.1, 0.2, 0.3])
    texts = events.Tensors("eval/samples/text_summary")
    table = texts[0].tensor_proto.string_val[0].decode()
    assert [t.step for t in texts] == [0, 2] and "| source | prompt |" in table
    assert "2 \\| two ⏎ ok" in table  # one row per sample, whatever the response holds
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    (records,) = run.glob("run-*.wandb")
    data = records.read_bytes()
    assert b"eval/pass@1" in data and b"eval/samples" in data and b"two" in data

    resumed = Outputs(tmp_path, 3, first_step=2, tensorboard=False, progress=False)
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "eval_samples.jsonl").open()]
    assert steps == [0, 0] and [r["step"] for r in resumed.history] == [1]


def test_threads_per_role_share_the_cpus_among_the_roles_that_compute_at_once(monkeypatch):
    from pathlib import Path

    from ferrule_launcher.load import load_config
    from ferrule_launcher.placement import role_env, threads_per_role

    example = Path(__file__).resolve().parents[3] / "examples" / "tiny.toml"

    def threads(**overrides):
        return threads_per_role(load_config(example, {"ray.num_cpus": 8, **overrides}))

    # the synchronous loop: the engine generates, then the reference's forward, then the
    # policy trains; one at a time, each gets every CPU
    assert threads() == 8
    assert threads(**{"loop.mode": "async"}) == 4  # the engine generates while the policy trains
    assert threads(**{"rollout.engines": 4}) == 2
    assert threads(**{"trainer.ranks": 2, "trainer.reference_ranks": 2}) == 4
    # two epochs: the policy's old-logprob pass runs beside the reference's
    assert threads(**{"trainer.epochs": 2}) == 4
    assert threads(**{"ray.num_cpus": 3, "loop.mode": "async", "rollout.engines": 4}) == 1
    assert threads(**{"ray.threads_per_role": 3}) == 3  # the user's word wins
    assert threads(**{"ray.address": "auto"}) == 1  # a joined cluster: nothing known here

    monkeypatch.setattr("ferrule_launcher.placement.has_cuda", lambda: False)
    assert role_env(5)["OMP_NUM_THREADS"] == "5"
    monkeypatch.setattr("ferrule_launcher.placement.has_cuda", lambda: True)
    assert "OMP_NUM_THREADS" not in role_env(5)


def test_ranks_that_step_cpu_adam_get_the_nodes_cores_not_rays_one_thread(monkeypatch):
    """Ray sets OMP_NUM_THREADS to the CPUs an actor asked for (1 at cpus_per_role = 0.5), and
    DeepSpeed's CPU Adam runs its loop on that many; a rank that steps on the host gets the
    node's cores shared by the ranks stepping with it, in its own environment only."""
    from pathlib import Path

    from ferrule_launcher.load import load_config
    from ferrule_launcher.placement import Role, optimizer_threads, with_threads

    example = Path(__file__).resolve().parents[3] / "examples" / "tiny.toml"
    monkeypatch.setattr("ferrule_launcher.placement.has_cuda", lambda: True)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))

    def threads(**overrides):
        keys = {"trainer.offload_optimizer": True, "ray.num_cpus": 2, **overrides}
        return optimizer_threads(load_config(example, keys))

    assert threads() == 16  # this machine's cores, not the 2 that Ray schedules by
    assert threads(**{"trainer.ranks": 4}) == 4
    assert threads(**{"trainer.ranks": 2, "critic.ranks": 2, "trainer.estimator": "gae"}) == 4
    assert threads(**{"trainer.ranks": 32}) == 1
    assert threads(**{"ray.threads_per_role": 3}) == 3  # the user's word wins
    assert threads(**{"trainer.offload_optimizer": False}) is None  # nothing steps on the host
    monkeypatch.setattr("ferrule_launcher.placement.has_cuda", lambda: False)
    assert threads() is None  # CPU machines: threads_per_role's rule for every role

    places = {Role(kind): {"num_cpus": 0.5} for kind in ("policy", "reference", "rollout")}
    given = with_threads(places, ("policy", "critic"), {"PYTHONPATH": "x"}, 16)
    env = {"PYTHONPATH": "x", "OMP_NUM_THREADS": "16"}
    assert given[Role("policy")] == {"num_cpus": 0.5, "runtime_env": {"env_vars": env}}
    assert given[Role("reference")] == given[Role("rollout")] == {"num_cpus": 0.5}


def test_a_module_without_bytecode_is_warned_of_where_none_is_written(tmp_path, monkeypatch):
    """Every role would compile such a module from source at each start (torch on the GPU
    machines' image: ~8 s a role); the warning names it, its folder and the command that fixes it.
    Found without importing it."""
    import py_compile
    import sys

    from ferrule_launcher.placement import bytecode_warning

    package = tmp_path / "slowpkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    warning = bytecode_warning("slowpkg", writes_bytecode=False)
    assert warning and "slowpkg" in warning and str(tmp_path) in warning
    assert f"{sys.executable} -m compileall -q -j 0 {tmp_path}" in warning
    assert bytecode_warning("slowpkg", writes_bytecode=True) is None  # the first import writes it
    assert bytecode_warning("no_such_module_here", writes_bytecode=False) is None
    py_compile.compile(str(package / "__init__.py"))
    assert bytecode_warning("slowpkg", writes_bytecode=False) is None


def test_device_memory_is_not_asked_of_roles_without_gpus():
    """Two Ray round trips per step (GPU memory after generating and after training) are made
    only where the roles have GPUs; on CPU the metric is 0 without a call."""
    from types import SimpleNamespace

    from ferrule_launcher.loop import Loop

    class Unreachable:
        def __getattr__(self, name):
            raise AssertionError(f"the policy's workers were asked ({name})")

    def loop(gpus: float):
        config = SimpleNamespace(ray=SimpleNamespace(gpus_per_role=gpus))
        return SimpleNamespace(config=config, roles=Unreachable())

    assert Loop._device_memory(loop(0.0)) == 0.0
    with pytest.raises(AssertionError, match="asked"):
        Loop._device_memory(loop(1.0))


def test_the_roles_start_with_the_arguments_the_config_gives_them():
    """run.role_setup hands start_roles each role's keyword arguments and the weight sync's
    settings; roles.py never sees the config."""
    from pathlib import Path

    from ferrule_launcher.load import load_config
    from ferrule_launcher.roles import WeightSync
    from ferrule_launcher.run import role_setup

    example = Path(__file__).resolve().parents[3] / "examples" / "tiny.toml"
    config = load_config(example, {"trainer.estimator": "gae", "critic.learning_rate": 1e-5})
    setup = role_setup(config, "/model")
    assert setup.model_path == "/model" and setup.critic_path is None
    temperature = config.rollout.temperature
    assert setup.policy["temperature"] == setup.reference["temperature"] == temperature
    assert setup.policy["learning_rate"] == config.trainer.learning_rate
    assert setup.critic["learning_rate"] == 1e-5 and "temperature" not in setup.critic
    assert "learning_rate" not in setup.reference  # a frozen Actor has no optimizer
    assert setup.engine["dtype"] == config.model.dtype and "seed" not in setup.engine
    assert setup.weight_sync == WeightSync("ipc", 1, in_place=True)  # colocate_all: "auto" is ipc

    apart = load_config(example, {"ray.placement": "separate", "rollout.tensor_parallel_size": 2})
    assert role_setup(apart, "/model").weight_sync == WeightSync("broadcast", 2, in_place=True)
    offload = load_config(
        example, {"trainer.offload_between_phases": True, "trainer.zero_stage": 2}
    )
    assert not role_setup(offload, "/model").weight_sync.in_place
    exact = load_config(example, {"rollout.exact": True, "rollout.backend": "transformers"})
    exact_setup = role_setup(exact, "/model")
    assert exact_setup.policy["prepare_model"] == exact_setup.reference["prepare_model"]
    assert "prepare_model" not in setup.policy
    # compiled decoder layers by default; eager under exact numerics (inductor reorders math)
    assert setup.policy["compile_layers"] and setup.reference["compile_layers"]
    assert setup.critic["compile_layers"]
    assert not exact_setup.policy["compile_layers"] and not exact_setup.reference["compile_layers"]


def test_a_training_call_reports_the_slowest_rank_and_every_rank_s_compiles(monkeypatch):
    """A rank that compiles (a compiled layer meeting a new input form) holds every rank up at
    the next collective: the step's metrics say how long the slowest rank took and how many
    graphs were built, where rank 0's own figures could show nothing."""
    import torch

    from ferrule_launcher.roles import _timed

    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=True)

    def train(rows):
        compiled(torch.ones(rows))
        return {"loss": 0.5}

    first = _timed(lambda: train(3))
    assert first["compiles"] == 1 and first["seconds"] > 0
    assert first["loss"] == 0.5
    again = _timed(lambda: train(5))
    assert again["compiles"] == 0  # any length after the first: the same graph

    ranks = [
        {"loss": 0.5, "seconds": 6.6, "compiles": 0},
        {"loss": 0.5, "seconds": 16.4, "compiles": 28},
        {"loss": 0.5, "seconds": 6.7, "compiles": 0},
    ]
    monkeypatch.setattr(calls, "get", lambda refs, role: ranks)
    metrics = calls.RankGroup([None] * 3, "policy")._merged(["refs"])()
    assert metrics == {"loss": 0.5, "seconds": 16.4, "compiles": 28}
    assert ranks[0]["seconds"] == 6.6  # rank 0's own result is left as it was


def test_a_sequence_groups_ranks_get_the_same_rows_and_its_results_count_once(monkeypatch):
    """[trainer] sequence_parallel = 2 over 4 ranks: ranks 0-1 share rows 0-3, ranks 2-3 rows
    4-7, and the log-probabilities put back hold each row once."""
    import torch

    from ferrule_trainer.batch import Batch

    ids = torch.arange(8)[:, None].repeat(1, 3)
    batch = Batch(ids, torch.ones_like(ids), torch.ones(8, 1, dtype=torch.long))
    group = calls.RankGroup(["w0", "w1", "w2", "w3"], "policy", sequence_parallel=2)
    shards = group._on_shards(batch, lambda worker, shard: (worker, shard.input_ids[:, 0].tolist()))
    assert shards == [
        ("w0", [0, 1, 2, 3]),
        ("w1", [0, 1, 2, 3]),
        ("w2", [4, 5, 6, 7]),
        ("w3", [4, 5, 6, 7]),
    ]
    monkeypatch.setattr(calls, "get", lambda refs, role: [torch.tensor(r[1]) for r in refs])
    assert group._joined(shards)().tolist() == list(range(8))
