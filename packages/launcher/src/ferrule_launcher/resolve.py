"""A loaded config made concrete for the machine it will run on. `load_config` reads the file
and nothing else. `resolve` then reads the model's config.json, the GPUs' memory size and the
nodes' host memory (from nvidia-smi and /proc/meminfo, or from [ray] gpu_memory_gb,
host_memory_gb and gpus_per_node: see plan.Machine), and fills in what the file left to the
machine:

    config = load_config("run.toml")         # the file's contents, validated
    resolved = resolve(config)               # Resolved(config, plan, unplanned)
    run(resolved.config)                     # rlhf-launch, --dry-run and --plan all go this way

- [trainer] sequence_parallel is checked against the model's attention heads.
- [trainer] reference_ranks "auto" puts a reference rank beside each policy rank when the
  placement shares their GPUs (measured on four H100s: the train phase took 19.7 s with one
  reference scoring every GPU's samples, 12.0 s with one reference per GPU).
- The [trainer] keys left "auto" on a GPU run get the memory plan's fastest choice that fits
  the GPUs and the host (plan.py). A plan that cannot fit is refused here, before any process
  starts, unless [ray] check_memory = false.
A dry run on a machine that shows no GPU may leave the plan's keys "auto" (`unplanned`).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from ferrule_config import ConfigError, format_problems
from ferrule_launcher.config import Config
from ferrule_launcher.plan import Machine, Plan, make_plan, refusal


@dataclass(frozen=True)
class Resolved:
    config: Config  # the plan's choices and the reference ranks filled in
    plan: Plan | None  # None for a CPU run
    unplanned: frozenset[str] = frozenset()  # [trainer] keys a dry run left "auto"


def resolve(
    config: Config, machine: Machine | None = None, dry_run: bool = False, refuse: bool = True
) -> Resolved:
    """Resolve `config` for `machine`. The default is this machine, queried only for a GPU run
    that sets neither [ray] gpu_memory_gb nor address. Raises ConfigError naming the file and
    the keys when the plan cannot read the model, when it cannot know the GPUs' size while
    [trainer] keys are "auto" (except in a dry run), or when the plan does not fit (unless
    `refuse` is False, as for `--plan`, or [ray] check_memory = false)."""
    heads = _sequence_parallel_heads(config)
    if heads:
        raise _refused(config, heads)
    config = _reference_beside_each_rank(config)
    if not config.ray.gpus_per_role:
        return Resolved(_marked(config), None)
    try:
        plan = make_plan(config, machine)
    except (OSError, ValueError) as err:  # config.json is unreadable, or not a decoder LM's
        problem = ("model.path", f"the memory plan cannot read the model: {err}")
        raise _refused(config, [problem]) from None
    if plan.memory is None:  # no GPU here, and no size given
        auto = config.trainer.auto
        if auto and not dry_run:
            keys = ", ".join(sorted(auto))
            raise _refused(
                config,
                [
                    (
                        "ray.gpu_memory_gb",
                        "this machine shows no GPU (nvidia-smi), so the memory plan cannot "
                        f"choose [trainer] {keys}: set gpu_memory_gb to the GPUs' size (e.g. "
                        "80), or set those keys",
                    )
                ],
            )
        return Resolved(_marked(config), plan, auto)
    if refuse and config.ray.check_memory and not plan.fits():
        raise _refused(config, refusal(plan))
    return Resolved(_marked(config, plan.trainer), plan)


def _sequence_parallel_heads(config: Config) -> list[tuple[str, str]]:
    """Check [trainer] sequence_parallel against the model's attention heads (read from a local
    model's config.json): each rank of a sequence group attends with 1/N of the heads."""
    size = config.trainer.sequence_parallel
    path = Path(config.model.path) / "config.json"
    if size == 1 or not path.is_file():
        return []
    heads = json.loads(path.read_text()).get("num_attention_heads")
    if not heads or heads % size == 0:
        return []
    return [
        (
            "trainer.sequence_parallel",
            f"the model's {heads} attention heads ({path}) must be a multiple of it: each rank "
            "of a group attends with heads / sequence_parallel of them",
        )
    ]


def _reference_beside_each_rank(config: Config) -> Config:
    t = config.trainer
    shared = config.ray.placement in ("colocate_all", "colocate")
    if t.reference_ranks_auto and config.ray.gpus_per_role and shared:
        trainer = t.model_copy(update={"reference_ranks": t.ranks})
        return config.model_copy(update={"trainer": trainer})
    return config


def _marked(config: Config, trainer=None) -> Config:
    """A copy of `config`, with `trainer`'s choices if given, marked as resolved."""
    copy = config.model_copy(update={"trainer": trainer} if trainer is not None else None)
    copy._resolved = True
    return copy


def _refused(config: Config, problems: list[tuple[str, str]]) -> ConfigError:
    return ConfigError(format_problems(config.source, problems))
