"""One run, start to end: Ray, reward server, SFT warm start, roles, the loop, outputs, shutdown.

    summary = run(load_config("examples/tiny.toml"), resume=False)   # resolved for this machine

Output directory layout ([output] dir):
    metrics.jsonl, tensorboard/, reward_curve.png, summary.json, rewards.log
    sft/model                 the warm-started model (sft/state: its resumable state)
    checkpoint/launcher.json  the last complete checkpoint (step, eval_before, ...)
    checkpoint/policy/stepN   the policy's resumable DeepSpeed states (and checkpoint/critic): the
                              newest [output] keep_last, plus the best by keep_best
    exports/stepN             the policy in Hugging Face format every [output] export_every steps
    roles.json                where each role runs (node, pid), the reward server's address
    .run.lock                 held (flock) by the run in progress: one run per directory
    policy/                   the final policy in Hugging Face format
Every process the run starts (Ray actors, the reward server) stops when the run ends, fails or
is interrupted. A rollout engine or reward server that dies is replaced ([rollout] and [rewards]
max_restarts); any other role that dies stops the run with an error that names it.
"""

import json
import os
import time
from pathlib import Path

from ferrule_launcher import outputs, run_lock
from ferrule_launcher.calls import RunError, get, get_each
from ferrule_launcher.config import Config
from ferrule_launcher.data import make_prompts
from ferrule_launcher.loop import Loop
from ferrule_launcher.resolve import resolve
from ferrule_launcher.roles import Roles, RoleSetup, WeightSync

__all__ = ["RunError", "run"]


def run(config: Config, resume: bool = False, prompts=None) -> dict:
    """Run `config`, resuming from its last checkpoint when `resume` is set. The config is first
    resolved for this machine (resolve.py) unless it already was. `prompts` is
    data.make_prompts(config), which the CLI reads before anything starts."""
    if not config.resolved:
        config = resolve(config).config
    prompts = prompts or make_prompts(config)
    # Ray reads this when it is imported. Under `uv run`, Ray would otherwise pack the working
    # directory and start every worker through uv again; the workers share this interpreter.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    out = Path(config.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    with run_lock.hold(out):  # before anything: a second run on `out` stops here
        return _run(config, out, resume, prompts)


def _run(config: Config, out: Path, resume: bool, prompts) -> dict:
    """Start the processes, resume or evaluate first, run the steps, and write the outputs.
    Every process started here is stopped however this function ends."""
    import ray

    started = time.monotonic()
    startup = outputs.StartupTimeline()
    state = outputs.last_checkpoint(out) if resume else None
    if not resume:
        outputs.clear_previous(out)
    if state:
        print(f"resuming from step {state['step']} ({out / 'checkpoint'})", flush=True)
    env = _start_ray(config, prompts, startup)
    processes, log = _Processes(), None
    try:
        loop = _start_roles(config, out, prompts, env, startup, processes)
        if state:
            first_step = _resume(out, processes.roles, loop, state)
            before, shown_before = state["eval_before"], None
            startup.mark("checkpoint")
        else:
            warming = loop.warm_up_trainer()  # the trainer compiles while the engines evaluate
            first_step, (before, shown_before) = 1, _evaluate_before(config, loop, prompts)
            startup.mark("evaluation")
            if max(get_each(warming), default=0.0) > 0:
                startup.mark("trainer compile (beyond the evaluation)")
        print(startup.describe(), flush=True)
        o = config.output
        log = outputs.Outputs(
            out,
            config.loop.steps,
            first_step,
            o.tensorboard,
            o.progress,
            wandb=_wandb_settings(config, out, loop.rollouts.launch_id) if o.wandb else None,
        )
        if not state:
            log.samples(0, shown_before)
        elapsed_before = state["wall_seconds"] if state else 0.0

        def wall_seconds() -> float:
            return elapsed_before + time.monotonic() - started

        kept = state.get("kept", []) if state else []  # checkpoints on disk, oldest first
        after_step = AfterEachStep(
            config, out, processes.roles, loop, log, before, wall_seconds, kept
        )
        if config.loop.mode == "sync":
            loop.run_sync(first_step, after_step)
        else:
            loop.run_async(first_step, after_step)
        summary = _summary(
            config, out, processes.roles, prompts, log.history, before, state, wall_seconds, startup
        )
        log.finish(summary)
        log = None
        return summary
    finally:
        if log is not None:
            log.close()
        processes.stop()
        ray.shutdown()


class _Processes:
    """What the run has started besides Ray, for `_run` to stop however it ends."""

    def __init__(self):
        self.rewards = None  # rewards_service.RewardService
        self.roles: Roles | None = None

    def stop(self) -> None:
        if self.roles is not None:
            self.roles.stop()
        if self.rewards is not None:
            self.rewards.stop()


def _start_ray(config: Config, prompts, startup: outputs.StartupTimeline) -> dict:
    """Start (or join) Ray with each role's thread settings; returns the roles' environment."""
    from ferrule_launcher.placement import bytecode_warning, role_env, start_ray, threads_per_role

    threads = threads_per_role(config)
    env = role_env(threads)
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    slow_start = bytecode_warning()
    if slow_start:
        print(f"warning: {slow_start}", flush=True)
    where = start_ray(config.ray, env)
    startup.mark("ray")
    on_cpu = f"; torch threads per role: {threads}" if "OMP_NUM_THREADS" in env else ""
    print(f"ray: {where}; placement {config.ray.placement}{on_cpu}", flush=True)
    print(f"prompts: {prompts.describe()}", flush=True)
    return env


def _start_roles(
    config: Config, out: Path, prompts, env: dict, startup, processes: _Processes
) -> Loop:
    """Start the reward server, run the SFT warm start, then start the roles (recorded in
    `processes` as each starts). Returns the loop that drives them."""
    import ray

    from ferrule_launcher.placement import (
        check_fits,
        optimizer_threads,
        place_roles,
        wanted_roles,
        with_threads,
    )
    from ferrule_launcher.reward_model_role import resources
    from ferrule_launcher.rewards_service import RewardService
    from ferrule_launcher.roles import start_roles, write_roles
    from ferrule_launcher.warm_start import warm_start

    if not config.ray.address:  # a joined cluster's nodes may still be joining
        model_role = resources(config.rewards, config.ray) if config.rewards.model else (0, 0)
        check_fits(config.ray, wanted_roles(config), ray.cluster_resources(), model_role)
    if config.needs_reward_server():  # not for episodes scored by their environment
        processes.rewards = RewardService.start(config.rewards, config.ray, out)
        startup.mark("reward server")
    model_path = warm_start(config, out)
    if config.sft.steps:
        startup.mark("SFT warm start")
    places, groups = place_roles(config.ray, wanted_roles(config))
    threads = optimizer_threads(config)
    if threads:
        places = with_threads(places, ("policy", "critic"), env, threads)
        print(f"CPU Adam: {threads} threads in each policy and critic rank", flush=True)
    setup = role_setup(config, model_path)
    processes.roles = start_roles(
        setup, places, groups, env, ready=startup.roles_ready, phases=startup.role_phases
    )
    startup.mark("roles")
    roles, rewards = processes.roles, processes.rewards
    write_roles(out / "roles.json", roles, rewards)
    return Loop(
        config,
        roles,
        rewards,
        prompts,
        _pad_id(model_path),
        on_engine_replaced=lambda: write_roles(out / "roles.json", roles, rewards),
    )


def _resume(out: Path, roles: Roles, loop: Loop, state: dict) -> int:
    """Load the checkpoint's trained states, loop state and weights; returns the first step."""
    _load_checkpoint(out, roles, state["step"])
    loop.restore(state.get("loop", {}))
    loop.sync(state["step"])  # the engines started with the warm start's weights
    loop.to_generate()
    return state["step"] + 1


def _evaluate_before(config: Config, loop: Loop, prompts) -> tuple[dict, list[dict]]:
    """Run the held-out evaluation before RL; returns its report and the samples to show."""
    loop.to_generate()
    before, shown = loop.rollouts.evaluate(0)
    print(
        f"before RL: {outputs.describe_eval(before)} ({len(prompts.held_out)} held-out prompts, "
        f"{config.eval.samples} samples each; {outputs.describe_generation(before)})",
        flush=True,
    )
    return before, shown


def _summary(
    config: Config, out: Path, roles: Roles, prompts, history, before, state, wall_seconds, startup
) -> dict:
    """The contents of summary.json, among them the evaluations before and after and the
    start-up timeline. It first checks the weights in every engine and saves the final policy;
    both count in the run's wall_seconds."""
    digests = _check_weights(config, roles, config.loop.steps)
    get(roles.policy.save_hf(str(out / "policy")), "policy")
    return {
        "eval_before": before,
        **_eval_after(before, history),
        "steps": config.loop.steps,
        "wall_seconds": round(wall_seconds(), 1),
        "resumed_from_step": state["step"] if state else 0,
        "skipped_steps": outputs.skipped_steps(history),
        "startup_seconds": startup.as_dict(),
        "mode": config.loop.mode,
        "estimator": config.trainer.estimator,
        **prompts.summary(),
        **outputs.reward_summary(history),
        "weights_digest": digests,
        "policy": str(out / "policy"),
    }


class AfterEachStep:
    """What the run does once a step has trained, in order: export the policy (every
    [output] export_every steps), save a checkpoint (every checkpoint_every steps but the last),
    log the step's metrics and samples, then mark the checkpoint complete and delete the
    checkpoints that retention no longer keeps. The checkpoint is saved before the metrics are
    logged, because the metrics show its seconds, and it is marked complete after them: a run
    killed in between resumes from the previous checkpoint."""

    def __init__(
        self,
        config: Config,
        out: Path,
        roles: Roles,
        loop: Loop,
        log,
        eval_before,
        wall_seconds,
        kept: list[dict],
    ):
        self.config, self.out, self.roles, self.loop, self.log = config, out, roles, loop, log
        self.eval_before, self.wall_seconds = eval_before, wall_seconds
        self.kept = kept  # the complete checkpoints on disk, oldest first

    def __call__(self, step: int, metrics: dict, shown: list[dict] | None) -> None:
        o = self.config.output
        if o.export_every and step % o.export_every == 0:
            began = time.perf_counter()
            get(
                self.roles.policy.save_hf(str(self.out / "exports" / f"step{step}")),
                "policy (export)",
            )
            metrics["time/export"] = time.perf_counter() - began
        every = o.checkpoint_every
        checkpoint = every and step % every == 0 and step < self.config.loop.steps
        if checkpoint:
            began = time.perf_counter()
            metrics.update(_save_checkpoint(self.out, self.roles, step))
            metrics["time/checkpoint"] = time.perf_counter() - began
        metrics["wall_seconds"] = round(self.wall_seconds(), 3)
        self.log.log(step, metrics)
        if shown:
            self.log.samples(step, shown)
        if checkpoint:
            self._complete(step, metrics.get(o.keep_best) if o.keep_best else None)

    def _complete(self, step: int, value: float | None) -> None:
        o = self.config.output
        now = [*self.kept, {"step": step, "value": value}]
        keep = outputs.retained(now, o.keep_last, o.keep_best, o.keep_best_mode)
        outputs.mark_checkpoint(
            self.out, step, self.eval_before, self.wall_seconds(), self.loop.state(), keep
        )
        outputs.drop_checkpoints(self.out, [c["step"] for c in now if c not in keep])
        self.kept = keep


def _eval_after(before: dict, history: list[dict]) -> dict:
    """The summary's eval_after (the last step's evaluation; the last step always has one), and
    the accuracy before and after where the evaluations report one."""
    evaluated = [r for r in history if "eval/reward" in r]
    after = {k[5:]: v for k, v in evaluated[-1].items() if k.startswith("eval/")}
    return {"eval_after": after, **_task_accuracy(before, after)}


def role_setup(config: Config, model_path: str) -> RoleSetup:
    """What each role starts with: the keyword arguments of the policy's, the reference's and
    the critic's ranks and of the engines, and how the weight sync runs."""
    t, r, m, seed = config.trainer, config.rollout, config.model, config.loop.seed
    model = dict(dtype=m.dtype, attn_implementation=m.attn_implementation, seed=seed)
    # no compiled layers in exact mode (inductor reorders the math), nor with sequence
    # parallelism (its attention all-to-alls are not compiled)
    model["compile_layers"] = m.compile_layers and not r.exact and t.sequence_parallel == 1
    scoring = {}  # the policy and the reference compute as the engines do (ferrule_rollout.exact)
    if r.exact:
        from ferrule_rollout.exact import ExactNumerics

        scoring["prepare_model"] = ExactNumerics(r.max_model_len).apply
    steps = config.loop.steps
    critic, critic_path = None, None
    if config.critic is not None:
        critic = dict(
            sequence_parallel=t.sequence_parallel,
            **t.optimizer_options(steps, config.critic.learning_rate),
            **model,
        )
        if config.critic.init == "reward_model":  # the config check ensured [rewards] model
            critic_path = str(config.rewards.model)
    transport = r.transport
    if transport == "auto":
        transport = "ipc" if config.ray.placement == "colocate_all" else "broadcast"
    return RoleSetup(
        model_path=model_path,
        policy=dict(
            temperature=r.temperature,
            sequence_parallel=t.sequence_parallel,
            **t.optimizer_options(steps),
            **t.lora_options(),
            **model,
            **scoring,
        ),
        reference=dict(
            zero_stage=t.zero_stage,
            temperature=r.temperature,
            sequence_parallel=t.sequence_parallel,
            **model,
            **scoring,
        ),
        engine_class=r.engine_class(),
        engine=dict(dtype=m.dtype, **r.engine_options()),
        seed=seed,
        weight_sync=WeightSync(
            transport, r.tensor_parallel_size, in_place=not t.offload_between_phases
        ),
        critic=critic,
        critic_path=critic_path,
    )


def _wandb_settings(config: Config, out: Path, launch_id: str) -> dict:
    """wandb.init's arguments: one W&B run per launch, grouped by the output directory."""
    o = config.output
    return {
        "project": o.wandb_project,
        "mode": o.wandb_mode,
        "dir": str(out),
        "group": out.resolve().name,
        "name": f"{out.resolve().name}-{launch_id}",
        "config": config.model_dump(mode="json"),
    }


def _task_accuracy(before: dict, after: dict) -> dict:
    """Greedy accuracy at the top of the summary: the synthetic tasks' exact match, or the
    success rate of multi-turn episodes."""
    if "accuracy" not in after:
        return {}
    return {"accuracy_before": before.get("accuracy"), "accuracy_after": after["accuracy"]}


def _pad_id(model_path: str) -> int:
    """Padding only fills masked positions; any id in the vocabulary does."""
    model = json.loads((Path(model_path) / "config.json").read_text())
    for key in ("pad_token_id", "eos_token_id"):
        if isinstance(model.get(key), int):
            return model[key]
    return 0


def _check_weights(config: Config, roles: Roles, version: int) -> dict:
    """After the last sync, check that every engine holds policy `version`, and return the
    digests of the policy's weights and of every engine that can report what it holds (the
    transformers engine; vLLM keeps its weights in its own layout). A RunError names an engine
    that holds another version or other weights."""
    engines = list(enumerate(roles.engines))
    versions = get_each(
        [(e.__ray_call__.remote(_held_version), f"rollout engine {i}") for i, e in engines]
    )
    behind = [i for i, held in enumerate(versions) if held != version]
    if behind:
        raise RunError(
            f"rollout engine(s) {behind} hold policy versions {versions} after the last weight "
            f"sync, not {version}"
        )
    policy = get(roles.policy.weights_digest(), "policy")[0]
    if config.rollout.backend != "transformers":
        return {"policy": policy, "engine_versions": versions}
    digests = get_each([(e.weights_digest.remote(), f"rollout engine {i}") for i, e in engines])
    differ = [i for i, d in enumerate(digests) if d != policy]
    if differ:
        raise RunError(
            f"rollout engine(s) {differ} hold weights that differ from the policy's after the "
            f"last weight sync (digests {digests} against the policy's {policy})"
        )
    return {"policy": policy, "engines": digests, "engine_versions": versions}


def _held_version(engine) -> int:  # runs inside an engine's actor, through __ray_call__
    return engine.version


def _save_checkpoint(out: Path, roles: Roles, step: int) -> dict[str, float]:
    """Save the policy's (and critic's) resumable states of `step` under out/checkpoint.
    Returns the seconds each role's slowest rank spent writing its weights and its optimizer
    (`time/checkpoint/policy_weights`, ...), as the ranks write at the same time."""
    directory = out / "checkpoint"
    groups = {"policy": roles.policy}
    if roles.critic is not None:
        groups["critic"] = roles.critic
    refs = {role: group.save(str(directory / role), step) for role, group in groups.items()}
    seconds = {}
    for role, ranks in refs.items():
        by_rank = get(ranks, f"{role} checkpoint")
        for part in ("weights", "optimizer"):
            seconds[f"time/checkpoint/{role}_{part}"] = max(s[part] for s in by_rank)
    return seconds


def _load_checkpoint(out: Path, roles: Roles, step: int) -> None:
    directory = out / "checkpoint"
    get(roles.policy.load(str(directory / "policy"), step), "policy")
    if roles.critic is not None:
        get(roles.critic.load(str(directory / "critic"), step), "critic")
