"""One run, start to end: Ray, reward server, SFT warm start, roles, the loop, outputs, shutdown.

    summary = run(load_config("examples/tiny.toml"), resume=False)

Output directory layout ([output] dir):
    metrics.jsonl, tensorboard/, reward_curve.png, summary.json, rewards.log
    sft/model                 the warm-started model (sft/state: its resumable state)
    checkpoint/launcher.json  the last complete checkpoint (step, accuracy_before, ...)
    checkpoint/policy/stepN   the policy's resumable DeepSpeed state (and checkpoint/critic)
    roles.json                where each role runs (node, pid), the reward server's address
    policy/                   the final policy in Hugging Face format
Every process the run starts (Ray actors, the reward server) stops when it ends, fails or is
interrupted; a role that dies stops the run with an error that names it.
"""

import json
import os
import time
from pathlib import Path

from ferrule_launcher.config import Config
from ferrule_launcher.loop import Loop, PolicyGroup, Roles, RunError, get, get_each
from ferrule_launcher.outputs import Outputs
from ferrule_launcher.task import eval_problems, held_out_problems, step_problems

__all__ = ["RunError", "run"]


def run(config: Config, resume: bool = False) -> dict:
    # Under `uv run`, Ray would pack the working directory and start every worker through uv
    # again (its uv hook, read when ray is imported); the workers share this interpreter.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    from ferrule_launcher.placement import place_roles, role_env, start_ray
    from ferrule_launcher.rewards_service import RewardService, RewardServiceError

    started = time.monotonic()
    out = Path(config.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    state = _read_checkpoint(out) if resume else None
    if not resume:
        _clear_previous(out)
    if state:
        print(f"resuming from step {state['step']} ({out / 'checkpoint'})", flush=True)
    env = role_env()
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    where = start_ray(config.ray, env)
    print(f"ray: {where}; placement {config.ray.placement}", flush=True)
    rewards = outputs = None
    actors, groups = [], []
    try:
        try:
            rewards = RewardService.start(config.rewards, out / "rewards.log")
            rewards.check()
        except RewardServiceError as err:
            raise RunError(str(err)) from None
        model_path = _warm_start(config, out)
        roles, actors, groups = _start_roles(config, model_path, place_roles, env)
        _write_roles(out / "roles.json", roles, rewards)
        pad_id = _pad_id(model_path)
        held_out = held_out_problems(config.task)
        loop = Loop(config, roles, _Scorer(rewards), held_out, pad_id)
        first_step = 1
        if state:
            first_step = state["step"] + 1
            get(
                roles.policy.call("load", str(out / "checkpoint" / "policy"), state["step"]),
                "policy",
            )
            if roles.critic is not None:
                get(
                    roles.critic.load_state.remote(
                        str(out / "checkpoint" / "critic"), f"step{state['step']}"
                    ),
                    "critic",
                )
            loop.sync(state["step"])  # the engines started from the warm start's weights
            accuracy_before = state["accuracy_before"]
        else:
            accuracy_before = loop.evaluate()
            print(
                f"accuracy_before = {accuracy_before:.3f} (greedy, {len(held_out)} held-out "
                "prompts)",
                flush=True,
            )
        outputs = Outputs(
            out, config.loop.steps, first_step, config.output.tensorboard, config.output.progress
        )
        elapsed_before = state["wall_seconds"] if state else 0.0

        def on_step(step: int, metrics: dict) -> None:
            metrics["wall_seconds"] = round(elapsed_before + time.monotonic() - started, 3)
            outputs.log(step, metrics)
            every = config.output.checkpoint_every
            if every and step % every == 0 and step < config.loop.steps:
                _save_checkpoint(
                    out, roles, step, accuracy_before, elapsed_before + time.monotonic() - started
                )

        if config.loop.mode == "sync":
            loop.run_sync(first_step, on_step)
        else:
            loop.run_async(first_step, on_step)
        last = [r for r in outputs.history if "eval/accuracy" in r]
        accuracy_after = last[-1]["eval/accuracy"] if last else loop.evaluate()
        get(roles.policy.call("save_hf", str(out / "policy")), "policy")
        rewards_seen = [r["reward"] for r in outputs.history if "reward" in r]
        summary = {
            "accuracy_before": accuracy_before,
            "accuracy_after": accuracy_after,
            "steps": config.loop.steps,
            "wall_seconds": round(elapsed_before + time.monotonic() - started, 1),
            "resumed_from_step": state["step"] if state else 0,
            "mode": config.loop.mode,
            "estimator": config.trainer.estimator,
            "reward_first": rewards_seen[0] if rewards_seen else None,
            "reward_last": rewards_seen[-1] if rewards_seen else None,
            "reward_first_quarter": _mean(rewards_seen[: max(len(rewards_seen) // 4, 1)]),
            "reward_last_quarter": _mean(rewards_seen[-max(len(rewards_seen) // 4, 1) :]),
            "policy": str(out / "policy"),
        }
        outputs.finish(summary)
        outputs = None
        return summary
    finally:
        if outputs is not None:
            outputs.close()
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for group in groups:  # on a shared cluster, give the resources back at once
            ray.util.remove_placement_group(group)
        if rewards is not None:
            rewards.stop()
        ray.shutdown()


class _Scorer:
    """The reward service with its failures turned into RunError."""

    def __init__(self, service):
        self.service = service

    def score(self, prompts, responses, labels):
        from ferrule_launcher.rewards_service import RewardServiceError

        try:
            return self.service.score(prompts, responses, labels)
        except RewardServiceError as err:
            raise RunError(str(err)) from None


def _pad_id(model_path: str) -> int:
    """Padding only fills masked positions; any id in the vocabulary does."""
    model = json.loads((Path(model_path) / "config.json").read_text())
    for key in ("pad_token_id", "eos_token_id"):
        if isinstance(model.get(key), int):
            return model[key]
    return 0


def _mean(values):
    return sum(values) / len(values) if values else None


def _warm_start(config: Config, out: Path) -> str:
    """The model the RL stage starts from: [model] path, or that after the SFT warm start."""
    if not config.sft.steps:
        return str(config.model.path)
    target = out / "sft" / "model"
    if (target / "config.json").exists():
        return str(target)
    import ray

    from ferrule_launcher.workers import run_sft

    data = out / "sft" / "data.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    c = config.task
    held_out = eval_problems(c.name, c.length, c.eval_prompts, c.seed)
    with open(data, "w") as f:
        for step in range(config.sft.steps):  # negative steps: never the RL prompts
            for prompt, answer in step_problems(
                c.name, c.length, config.sft.batch_size, c.seed, -1 - step, held_out
            ):
                f.write(json.dumps({"prompt": prompt, "response": answer}) + "\n")
    print(f"sft: {config.sft.steps} steps of warm start on {c.name}", flush=True)
    start = time.monotonic()
    task = ray.remote(num_cpus=0.5, max_calls=1)(run_sft)
    path = get(
        task.remote(
            str(config.model.path),
            str(data),
            str(out / "sft"),
            config.sft.steps,
            config.sft.batch_size,
            config.sft.learning_rate,
            config.model.dtype,
            config.loop.seed,
        ),
        "sft warm start",
    )
    print(f"sft: done in {time.monotonic() - start:.0f} s -> {path}", flush=True)
    return path


def _start_roles(config: Config, model_path: str, place_roles, env: dict):
    import ray

    from ferrule_launcher.workers import PolicyWorker
    from ferrule_rollout.engine import RolloutEngine
    from ferrule_trainer.actor import Actor
    from ferrule_trainer.critic import Critic

    t, r = config.trainer, config.rollout
    roles = [f"policy-{i}" for i in range(t.ranks)]
    if t.kl_coef > 0:
        roles.append("reference")
    if config.critic is not None:
        roles.append("critic")
    roles += [f"rollout-{i}" for i in range(r.engines)]
    options, groups = place_roles(config.ray, roles)
    dtype = config.model.dtype
    common = dict(runtime_env={"env_vars": env})
    workers = [
        ray.remote(PolicyWorker).options(**options[f"policy-{i}"], **common).remote()
        for i in range(t.ranks)
    ]
    master = get(workers[0].where.remote(), "policy rank 0")
    setups = [
        w.setup.remote(
            model_path,
            i,
            t.ranks,
            master["host"],
            master["port"],
            zero_stage=t.zero_stage,
            dtype=dtype,
            learning_rate=t.learning_rate,
            max_grad_norm=t.max_grad_norm,
            temperature=r.temperature,
            seed=config.loop.seed,
        )
        for i, w in enumerate(workers)
    ]
    actors = list(workers)
    reference = critic = None
    if "reference" in roles:
        reference = (
            ray.remote(Actor)
            .options(**options["reference"], **common)
            .remote(
                model_path,
                train=False,
                zero_stage=t.zero_stage,
                dtype=dtype,
                temperature=r.temperature,
                seed=config.loop.seed,
            )
        )
        actors.append(reference)
    if "critic" in roles:
        critic = (
            ray.remote(Critic)
            .options(**options["critic"], **common)
            .remote(
                model_path,
                zero_stage=t.zero_stage,
                dtype=dtype,
                learning_rate=config.critic.learning_rate,
                max_grad_norm=t.max_grad_norm,
                seed=config.loop.seed,
            )
        )
        actors.append(critic)
    engines = []
    for i in range(r.engines):
        engine = (
            ray.remote(RolloutEngine)
            .options(**options[f"rollout-{i}"], **common, max_concurrency=4)
            .remote(
                model_path,
                dtype="float32" if dtype == "fp32" else "bfloat16",
                max_model_len=r.max_model_len,
                seed=config.loop.seed + i,
                gpu_memory_utilization=r.gpu_memory_utilization,
            )
        )
        engines.append(engine)
    actors += engines
    # Wait for every role to start, naming the one that could not.
    get_each([(ref, f"policy rank {i}") for i, ref in enumerate(setups)])
    if reference is not None:
        get(reference.__ray_ready__.remote(), "reference")
    if critic is not None:
        get(critic.__ray_ready__.remote(), "critic")
    for i, engine in enumerate(engines):
        get(engine.__ray_ready__.remote(), f"rollout engine {i}")
    _open_weight_sync(config, workers[0], engines)
    return Roles(PolicyGroup(workers), engines, reference, critic), actors, groups


def _whereabouts(self) -> dict:  # runs inside an actor, through __ray_call__
    import os

    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "node_ip": ray.util.get_node_ip_address(),
    }


def _write_roles(path: Path, roles: Roles, rewards) -> None:
    """Which node and process each role runs in (for people, and for the placement tests)."""
    handles = {f"policy-{i}": w for i, w in enumerate(roles.policy.workers)}
    handles.update(reference=roles.reference, critic=roles.critic)
    handles.update({f"rollout-{i}": e for i, e in enumerate(roles.engines)})
    where = {
        name: get(handle.__ray_call__.remote(_whereabouts), name)
        for name, handle in handles.items()
        if handle is not None
    }
    if rewards.process is not None:
        where["rewards"] = {"pid": rewards.process.pid, "address": rewards.addresses[0]}
    path.write_text(json.dumps(where, indent=2) + "\n")


def _open_weight_sync(config: Config, policy, engines) -> None:
    transport = config.rollout.transport
    if transport == "auto":
        transport = "ipc" if config.ray.placement == "colocate_all" else "broadcast"
    here = get(policy.where.remote(), "policy")
    sender = policy.open_sender.remote(transport, here["host"], here["port"], len(engines))
    joined = [
        e.init_weight_sync.remote(transport, here["host"], here["port"], i + 1, len(engines))
        for i, e in enumerate(engines)
    ]
    get_each(
        [(sender, "policy (weight sync sender)")]
        + [(ref, f"rollout engine {i} (weight sync receiver)") for i, ref in enumerate(joined)]
    )


# -- checkpoints ---------------------------------------------------------------------------


def _save_checkpoint(
    out: Path, roles: Roles, step: int, accuracy_before: float, wall_seconds: float
) -> None:
    """Policy (and critic) state first, then launcher.json: a checkpoint counts once its
    launcher.json names it, so a kill in between resumes from the previous one."""
    directory = out / "checkpoint"
    refs = roles.policy.call("save", str(directory / "policy"), step)
    if roles.critic is not None:
        refs.append(roles.critic.save_state.remote(str(directory / "critic"), step=step))
    get(refs, "policy/critic checkpoint")
    record = {"step": step, "accuracy_before": accuracy_before, "wall_seconds": wall_seconds}
    tmp = directory / "launcher.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, directory / "launcher.json")


def _read_checkpoint(out: Path) -> dict | None:
    path = out / "checkpoint" / "launcher.json"
    return json.loads(path.read_text()) if path.exists() else None


def _clear_previous(out: Path) -> None:
    """A fresh run (no --resume) does not mix with an old one in the same directory."""
    import shutil

    for name in ("checkpoint", "sft", "policy", "tensorboard"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "summary.json", "reward_curve.png"):
        (out / name).unlink(missing_ok=True)
