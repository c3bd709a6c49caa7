"""The rules that span a run's tables: settings that are valid alone but contradict one another.

Each `check_*` takes a `Config` and returns its problems as (dotted key, message) pairs, where
the key is the one to change; it returns none when the rule holds. `problems` runs every rule of
CROSS_TABLE and, only when none is broken, `check_files`: a contradiction is the first thing to
mend, a missing file the last. load.load_config calls `problems` on every config it loads. Each
rule is tested alone in packages/launcher/tests/test_checks.py.
"""

import importlib.util

from ferrule_launcher.config import Config
from ferrule_trainer.config import rl_batch_problems

Problem = tuple[str, str]


def check_sequence_parallel(config: Config) -> list[Problem]:
    """The critic's ranks share sequences in groups of the same size as the policy's ranks."""
    size, critic = config.trainer.sequence_parallel, config.critic
    if critic is not None and critic.ranks % size:
        return [
            (
                "critic.ranks",
                f"must be a multiple of [trainer] sequence_parallel = {size} (groups of ranks "
                f"share each sequence), got {critic.ranks}",
            )
        ]
    return []


def check_reward_source(config: Config) -> list[Problem]:
    """One of [rewards] function, model or address, unless the environment scores alone."""
    w = config.rewards
    given = [name for name in ("function", "model", "address") if getattr(w, name)]
    if not config.needs_reward_server():
        if not given:
            return []
        reason = (
            'unused: [environment] reward = "environment" scores episodes with the environment '
            "alone"
        )
        return [(f"rewards.{given[0]}", reason)]
    if len(given) != 1:
        return [
            (
                "rewards.function",
                f"give exactly one of function, model or address, got {given or 'none'}",
            )
        ]
    return []


def check_batch(config: Config) -> list[Problem]:
    """The trainer's mini-batches and estimator against the step's samples. The rule is
    ferrule-trainer's, and its own SFT / preference recipes share it."""
    r = config.rollout
    rows = r.prompts_per_step * r.samples_per_prompt
    return rl_batch_problems(config.trainer, config.critic, r.samples_per_prompt, rows)


def check_partial_rollout(config: Config) -> list[Problem]:
    """Partial rollouts continue samples across weight syncs: in async mode on vLLM (its pause
    mode "keep"), in sync mode on the transformers engine (a cut call continues in the next
    step)."""
    loop, backend = config.loop, config.rollout.backend
    if not loop.partial_rollout or loop.mode == "async":  # keys of sync partial rollouts unused
        why = 'only applies with partial_rollout = true and mode = "sync"'
        problems = []
        if loop.partial_cut != type(loop)().partial_cut:
            problems.append(("loop.partial_cut", why))
        if config.rollout.reuse_cut_kv:
            problems.append(("rollout.reuse_cut_kv", why))
        if problems or not loop.partial_rollout:
            return problems
    wanted = "vllm" if loop.mode == "async" else "transformers"
    if backend != wanted:
        return [
            (
                "loop.partial_rollout",
                f'with mode = "{loop.mode}" needs [rollout] backend = "{wanted}", got {backend!r}',
            )
        ]
    if loop.mode == "async":
        return []
    if config.rollout.exact:
        return [("loop.partial_rollout", "needs exact = false (a resumed run cannot repeat it)")]
    if loop.max_staleness < 1:
        return [
            ("loop.partial_rollout", "needs max_staleness >= 1 (a cut sample ends a step later)")
        ]
    return []


def check_exact(config: Config) -> list[Problem]:
    """Exact mode sets the attention of both the engine and the trainer, and it rules out LoRA:
    the engine's merged LoRA weights round differently from the trainer's."""
    if not config.rollout.exact:
        return []
    problems = []
    if config.trainer.lora_rank:
        problems.append(
            ("rollout.exact", "needs no LoRA (the engine's merged weights round differently)")
        )
    attention = config.model.attn_implementation
    if attention is not None:
        problems.append(
            (
                "model.attn_implementation",
                "[rollout] exact = true sets the attention of the engine and the trainer; "
                f"leave attn_implementation unset, got {attention!r}",
            )
        )
    return problems


def check_overlong_buffer(config: Config) -> list[Problem]:
    buffer, cap = config.trainer.overlong_buffer, config.rollout.max_tokens
    if buffer is not None and buffer > cap:
        return [("trainer.overlong_buffer", f"must be <= [rollout] max_tokens = {cap}")]
    return []


def check_data(config: Config) -> list[Problem]:
    """[task] sources against the task's name, and the data the warm start trains on."""
    task, sft, r, problems = config.task, config.sft, config.rollout, []
    if task.name != "data":
        if task.sources:
            problems.append(("task.sources", f'only read by name = "data", not {task.name!r}'))
        if sft.data is not None:
            problems.append(
                ("sft.data", f"the warm start of a {task.name!r} task uses its own answers")
            )
        return problems
    if not task.sources:
        problems.append(("task.sources", '"data" needs at least one [[task.sources]] table'))
    elif all(s.eval_path is None for s in task.sources):
        problems.append(("task.sources", "no source has an eval_path: nothing to evaluate on"))
    names = [s.name for s in task.sources]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(("task.sources", f"two sources are named {name!r}: set name"))
    if sft.steps and sft.data is None:
        problems.append(("sft.data", 'with name = "data" the warm start needs a data file'))
    room = r.max_model_len - r.max_tokens
    if task.max_prompt_tokens is not None and task.max_prompt_tokens > room:
        problems.append(
            (
                "task.max_prompt_tokens",
                f"must leave max_tokens ({r.max_tokens}) within max_model_len "
                f"({r.max_model_len}): at most {room}, got {task.max_prompt_tokens}",
            )
        )
    return problems


def check_recipe(config: Config) -> list[Problem]:
    """The recipes ([loop] algorithm "rejection_sampling" or "iterative_dpo") run synchronously
    and train no critic. A recipe's table is read only under its own algorithm."""
    algorithm = config.loop.algorithm
    problems = []
    for table in ("rejection_sampling", "iterative_dpo"):
        settings = getattr(config, table)
        changed = [
            k for k in type(settings).model_fields if getattr(settings, k) != _default(settings, k)
        ]
        if table != algorithm and changed:
            message = f"[{table}] is read only with [loop] algorithm = {table!r}, got {algorithm!r}"
            problems.append((f"{table}.{changed[0]}", message))
    if algorithm == "rl":
        return problems
    recipe = f"[loop] algorithm = {algorithm!r}"
    if config.loop.mode != "sync":
        problems.append(("loop.mode", f'{recipe} runs in mode = "sync"'))
    if config.critic is not None:
        problems.append(("critic.learning_rate", f"{recipe} trains no critic"))
    return problems


def _default(table, key: str):
    return type(table).model_fields[key].get_default(call_default_factory=True)


def check_reward_model_keys(config: Config) -> list[Problem]:
    """Keys that size the reward model, normalise its scores or start the critic from it need
    [rewards] model."""
    w, problems = config.rewards, []
    for key in ("gpus", "cpus"):
        if getattr(w, key) is not None and not w.model:
            problems.append(
                (f"rewards.{key}", "sizes the reward model's role: needs [rewards] model")
            )
    if w.normalize and not w.model:
        problems.append(("rewards.normalize", "needs [rewards] model (a reward model folder)"))
    elif w.normalize and not (w.model / "reward_stats.json").is_file():
        problems.append(
            ("rewards.normalize", f"no reward_stats.json in {w.model} (`rlhf-train rm` writes one)")
        )
    if config.critic is not None and config.critic.init == "reward_model" and not w.model:
        problems.append(
            (
                "critic.init",
                '"reward_model" starts the critic from [rewards] model, which is not set',
            )
        )
    return problems


def check_wandb(config: Config) -> list[Problem]:
    if config.output.wandb and importlib.util.find_spec("wandb") is None:
        return [("output.wandb", "needs the wandb package: pip install 'ferrule-launcher[wandb]'")]
    return []


def check_keep_best(config: Config) -> list[Problem]:
    """An eval/ metric is measured every eval_every steps, so every checkpoint must land on a
    step where it is measured."""
    best, every, checkpoint = (
        config.output.keep_best,
        config.loop.eval_every,
        config.output.checkpoint_every,
    )
    if best and best.startswith("eval/") and (not every or checkpoint % every):
        return [
            (
                "output.keep_best",
                f"{best!r} is measured every [loop] eval_every = {every} steps: "
                f"checkpoint_every ({checkpoint}) must be a multiple of it",
            )
        ]
    return []


def check_lengths(config: Config) -> list[Problem]:
    r = config.rollout
    if r.max_tokens >= r.max_model_len:
        return [
            ("rollout.max_tokens", f"must be < max_model_len {r.max_model_len}, got {r.max_tokens}")
        ]
    return []


def check_engines(config: Config) -> list[Problem]:
    r = config.rollout
    if r.prompts_per_step % r.engines:
        return [
            (
                "rollout.engines",
                f"must divide prompts_per_step {r.prompts_per_step}, got {r.engines}",
            )
        ]
    return []


def check_transport(config: Config) -> list[Problem]:
    """CUDA IPC and host memory need every role on one host."""
    transport = config.rollout.transport
    if transport in ("ipc", "host") and config.ray.placement != "colocate_all":
        return [
            (
                "rollout.transport",
                f'"{transport}" needs placement = "colocate_all" (one host); use "broadcast" '
                'or "auto"',
            )
        ]
    return []


def check_staleness(config: Config) -> list[Problem]:
    loop = config.loop
    if (
        loop.mode == "sync"
        and not loop.partial_rollout
        and loop.max_staleness != _default(loop, "max_staleness")
    ):
        return [("loop.max_staleness", 'only applies to mode = "async" or partial_rollout')]
    return []


def check_devices(config: Config) -> list[Problem]:
    """How the roles share devices: the hybrid engine's switches and GPU bundles."""
    t, r, ray, problems = config.trainer, config.rollout, config.ray, []
    switches = {
        "trainer.offload_between_phases": t.offload_between_phases,
        "rollout.sleep_between_phases": r.sleep_between_phases,
    }
    for key in [k for k, on in switches.items() if on]:
        if ray.placement != "colocate_all":
            problems.append((key, 'needs placement = "colocate_all" (roles sharing GPUs)'))
        elif config.loop.mode != "sync":
            problems.append((key, 'needs loop mode = "sync" (async overlaps the phases)'))
    if ray.gpus_per_role and ray.placement == "colocate_all" and r.engines != t.ranks:
        problems.append(
            (
                "rollout.engines",
                f'with placement = "colocate_all" on GPUs each GPU holds a policy rank and an '
                f"engine: must equal [trainer] ranks {t.ranks}, got {r.engines}",
            )
        )
    if ray.gpus_per_role and r.tensor_parallel_size > ray.gpus_per_role:
        problems.append(
            (
                "rollout.tensor_parallel_size",
                f"an engine's bundle has [ray] gpus_per_role = {ray.gpus_per_role:g} GPUs, "
                f"fewer than tensor_parallel_size {r.tensor_parallel_size}",
            )
        )
    return problems


def check_environment(config: Config) -> list[Problem]:
    """What multi-turn episodes do not run with (yet)."""
    if config.environment is None:
        return []
    problems = []
    if config.loop.algorithm != "rl":
        problems.append(("environment.name", '[loop] algorithm must be "rl" with episodes'))
    if config.loop.partial_rollout:
        problems.append(("loop.partial_rollout", "is not supported with [environment]"))
    return problems


def check_files(config: Config) -> list[Problem]:
    """The files and folders the run reads: reward function or model, environment, data."""
    problems = [(f"rewards.{key}", message) for key, message in config.rewards.missing()]
    if config.environment is not None:
        problems += [
            (f"environment.{key}", message) for key, message in config.environment.missing()
        ]
    for i, source in enumerate(config.task.sources):
        for key in ("path", "eval_path"):
            path = getattr(source, key)
            if path is not None and not path.exists():
                problems.append((f"task.sources.{i}.{key}", f"no file or folder {path}"))
    if config.sft.data is not None and not config.sft.data.is_file():
        problems.append(("sft.data", f"no file {config.sft.data}"))
    return problems


# in the order their problems are reported
CROSS_TABLE = (
    check_reward_source,
    check_batch,
    check_sequence_parallel,
    check_partial_rollout,
    check_exact,
    check_overlong_buffer,
    check_data,
    check_recipe,
    check_reward_model_keys,
    check_wandb,
    check_keep_best,
    check_lengths,
    check_engines,
    check_transport,
    check_staleness,
    check_devices,
    check_environment,
)


def problems(config: Config) -> list[Problem]:
    """The problems of every broken rule of CROSS_TABLE, in order; the missing files only when
    no rule is broken."""
    found = [problem for check in CROSS_TABLE for problem in check(config)]
    return found or check_files(config)
