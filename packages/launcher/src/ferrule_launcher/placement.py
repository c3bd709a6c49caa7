"""Ray: start or join a cluster, set the roles' environment, and place the roles with placement
groups.

    start_ray(config.ray, role_env(threads_per_role(config)))   # local, or join [ray] address
    places, groups = place_roles(config.ray, wanted_roles(config))  # {Role("policy", 0): options}
    ray.remote(RankWorker).options(**places[Role("policy", 0)]).remote()

Placements ([ray] placement):
- "colocate_all": one placement group with a bundle per policy rank (and rollout engine). Policy
  rank i, engine i, reference rank i and critic rank i share bundle i. On GPUs this is the
  hybrid engine: each GPU holds a policy rank and an engine.
- "colocate": the policy's ranks and the reference's in one group (a bundle per rank; reference
  rank i on policy rank i's bundle), the critic in another, and the rollout engines in a third
  (a bundle per engine). By default the groups' bundles are PACKed.
- "separate": every role in a placement group of its own.
`roles_on_nodes` adds a custom node resource to a role's bundle, which pins the role to that
node.
"""

import importlib.util
import os
import sys
from collections import Counter
from typing import NamedTuple

from ferrule_launcher.calls import RunError
from ferrule_launcher.config import Config, RayConfig

# Set in every role's process (Ray runtime_env) on machines without CUDA. vLLM and DeepSpeed
# read them at import time, so they must be in the environment before either is imported.
CPU_ENV = {
    "DS_ACCELERATOR": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class Role(NamedTuple):
    """One actor of the run: a rank of "policy", "reference" or "critic", or a "rollout"
    engine."""

    kind: str
    index: int = 0

    @property
    def name(self) -> str:
        """ "policy-1", "rollout-0", "reference" (rank 0), "critic-1": the name in roles.json."""
        numbered = self.kind in ("policy", "rollout") or self.index > 0
        return f"{self.kind}-{self.index}" if numbered else self.kind

    @property
    def label(self) -> str:
        """ "policy rank 1", "rollout engine 0", "critic", "critic rank 1": how errors name it."""
        if self.kind == "rollout":
            return f"rollout engine {self.index}"
        numbered = self.kind == "policy" or self.index > 0
        return f"{self.kind} rank {self.index}" if numbered else self.kind

    @property
    def pinned_as(self) -> str:
        """The kind `roles_on_nodes` pins this role by (the reference goes with the policy)."""
        return "policy" if self.kind == "reference" else self.kind


def wanted_roles(config: Config) -> list[Role]:
    """Every role the configuration asks for."""
    t = config.trainer
    wanted = [Role("policy", i) for i in range(t.ranks)]
    algorithm = config.loop.algorithm  # RL's KL needs the reference, and so does DPO
    with_reference = (algorithm == "rl" and t.kl_coef > 0) or algorithm == "iterative_dpo"
    wanted += [Role("reference", i) for i in range(t.reference_ranks if with_reference else 0)]
    wanted += [Role("critic", i) for i in range(config.critic.ranks if config.critic else 0)]
    return wanted + [Role("rollout", i) for i in range(config.rollout.engines)]


def threads_per_role(config: Config) -> int:
    """Torch threads for each role's process on a CPU machine: [ray] threads_per_role, else the
    local cluster's CPUs divided by the most roles that compute at one moment. The synchronous
    loop's phases take turns: the engines generate; then the reference, the critic and
    (off-policy) the policy run their forward passes together; then the policy and the critic
    train together. The asynchronous loop generates while it trains. Where the roles outnumber
    the CPUs, each role gets one thread: more threads than cores spin against each other."""
    if config.ray.threads_per_role:
        return config.ray.threads_per_role
    if config.ray.address:  # a joined cluster's nodes may differ from this machine
        return 1
    count = Counter(role.kind for role in wanted_roles(config))
    forwards = count["reference"] + count["critic"]
    if config.trainer.needs_old_logprobs():
        forwards += count["policy"]
    training = max(forwards, count["policy"] + count["critic"])
    if config.loop.mode == "async":
        busiest = training + count["rollout"]
    else:
        busiest = max(training, count["rollout"])
    cpus = config.ray.num_cpus or os.cpu_count() or 1
    return max(1, cpus // busiest)


def optimizer_threads(config: Config) -> int | None:
    """OpenMP threads for each policy and critic rank whose optimizer steps on the host, on GPU
    machines (DeepSpeed's CPU Adam: [trainer] offload_optimizer, which the critic shares); None
    where no optimizer steps there. Ray sets OMP_NUM_THREADS to the CPUs an actor asked for (1
    at the default [ray] cpus_per_role = 0.5), and CPU Adam's loop runs on that many threads:
    one core of a 16-core node for a 7B model's 91 GB of states. Instead, the node's cores are
    shared among the ranks that step on it at the same moment (all of them on a local cluster;
    at most one per GPU on a joined one). [ray] threads_per_role overrides this."""
    if not config.trainer.offload_optimizer or not has_cuda():
        return None
    if config.ray.threads_per_role:
        return config.ray.threads_per_role
    stepping = config.trainer.ranks + (config.critic.ranks if config.critic else 0)
    cpus, gpus = node_cores(config.ray)
    return max(1, cpus // min(stepping, gpus or stepping))


def node_cores(config: RayConfig) -> tuple[int, int | None]:
    """(cores, GPUs) of the node the ranks run on. On a local cluster: this machine's cores (not
    [ray] num_cpus, which is what Ray schedules by) and None GPUs, as every rank runs on this
    node. On a joined cluster: the GPU node with the fewest CPUs per GPU."""
    if not config.address:
        return len(os.sched_getaffinity(0)), None
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]
    if not nodes:
        return 1, None
    smallest = min(nodes, key=lambda r: r.get("CPU", 0) / r["GPU"])
    return int(smallest.get("CPU", 1)), int(smallest["GPU"])


def with_threads(places: dict[Role, dict], kinds: tuple[str, ...], env: dict, threads: int):
    """`places` with each role of `kinds` given its own environment: `env` and OMP_NUM_THREADS."""
    mine = {"env_vars": dict(env, OMP_NUM_THREADS=str(threads))}
    return {
        role: dict(options, runtime_env=mine) if role.kind in kinds else options
        for role, options in places.items()
    }


def start_ray(config: RayConfig, env: dict[str, str]) -> str:
    """ray.init: a local cluster (no dashboard) or the one at `config.address`."""
    import ray

    runtime_env = {"env_vars": env}
    if config.address:
        ray.init(address=config.address, runtime_env=runtime_env, log_to_driver=False)
        return "joined " + config.address
    num_cpus = config.num_cpus or os.cpu_count() or 1
    ray.init(
        # "local" starts a cluster of this run's own. Without an address, Ray would join the
        # cluster that RAY_ADDRESS names or that the last `ray start` on this machine began, and
        # would then refuse num_cpus. [ray] address = "auto" joins such a cluster on purpose.
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=runtime_env,
    )
    return f"local cluster ({num_cpus} CPUs)"


def role_env(threads: int) -> dict[str, str]:
    """Environment for every role's process: the CPU settings on machines without CUDA
    (among them OMP_NUM_THREADS = `threads`, torch's thread count), and the driver's own
    settings for caches and import paths."""
    env = {}
    if not has_cuda():
        env.update(CPU_ENV, OMP_NUM_THREADS=str(threads))
    for key in ("FERRULE_CACHE", "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def bytecode_warning(module: str = "torch", writes_bytecode: bool | None = None) -> str | None:
    """A warning when every role would compile `module` from source at each start. That happens
    when this Python writes no bytecode (PYTHONDONTWRITEBYTECODE or -B, which the roles inherit)
    and the module was installed without bytecode (pip --no-compile, or uv without
    compile-bytecode). Each role then compiles torch's ~2,000 modules as it starts: on an H200
    machine a policy rank's imports took 16 s that way, 7.4 s with the bytecode. The check does
    not import the module."""
    if writes_bytecode is None:
        writes_bytecode = not sys.flags.dont_write_bytecode
    spec = importlib.util.find_spec(module)
    if writes_bytecode or spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    site = os.path.dirname(os.path.dirname(spec.origin))
    return (
        f"{module} in {site} has no bytecode and this Python writes none "
        "(PYTHONDONTWRITEBYTECODE): every role compiles it from source at each start, seconds "
        f"each; write it once with: {sys.executable} -m compileall -q -j 0 {site}"
    )


def has_cuda() -> bool:
    """Whether this machine has NVIDIA GPUs, without importing torch in the driver."""
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def groups_for(placement: str, roles: list[Role]) -> dict[str, list[Role]]:
    """Which roles share a placement group: {group name: [roles]}."""
    if placement == "colocate_all":
        return {"all": list(roles)}
    if placement == "separate":
        return {role.name: [role] for role in roles}
    groups: dict[str, list[Role]] = {}
    for role in roles:  # colocate: the reference joins the policy's group
        groups.setdefault(role.pinned_as, []).append(role)
    return groups


def bundle_of(placement: str, role: Role) -> int:
    """The bundle a role takes in its group: its rank or engine index (with "colocate_all",
    policy rank i, reference rank i, critic rank i and engine i share bundle i)."""
    return role.index


def bundles(config: RayConfig, roles: list[Role]) -> dict[str, dict[int, list[Role]]]:
    """{group: {bundle index: roles on it}}: what place_roles asks Ray for."""
    plan = {}
    for name, members in groups_for(config.placement, roles).items():
        on_bundle: dict[int, list[Role]] = {}
        for role in members:
            index = bundle_of(config.placement, role) if len(members) > 1 else 0
            on_bundle.setdefault(index, []).append(role)
        plan[name] = {i: on_bundle.get(i, []) for i in range(max(on_bundle) + 1)}
    return plan


def check_fits(
    config: RayConfig,
    roles: list[Role],
    cluster: dict[str, float],
    rewards: tuple[float, float] = (0.0, 0.0),
) -> None:
    """Raise a RunError naming the keys when the bundles, plus the reward model's role
    (`rewards`: its GPUs and CPUs), ask for more CPUs or GPUs than the cluster has. This runs
    before any role starts, because Ray would otherwise wait for resources that never come."""
    count = sum(len(b) for b in bundles(config, roles).values())
    for resource, each, key, extra in (
        ("GPU", config.gpus_per_role, "gpus_per_role", rewards[0]),
        ("CPU", config.cpus_per_role, "cpus_per_role", rewards[1]),
    ):
        have, asked = cluster.get(resource, 0.0), count * each + extra
        if asked > have + 1e-9:
            also = (
                f" + the reward model's {extra:g} ([rewards] {resource.lower()}s)" if extra else ""
            )
            raise RunError(
                f"[ray] {key}: {count} bundles x {each:g} {resource}s{also} = {asked:g}, but the "
                f"Ray cluster has {have:g} (placement {config.placement!r}; [trainer] ranks, "
                "[rollout] engines and the critic / reference set how many bundles)"
            )


def place_roles(config: RayConfig, roles: list[Role]) -> tuple[dict[Role, dict], list]:
    """Ray actor options per role (placement group, bundle, resources), and the placement
    groups made.

    Roles on one bundle share it: each asks for an equal share of the bundle's CPUs / GPUs, so
    a bundle is as large as one role's request however many roles share it (they time-share a
    device).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options, made = {}, []
    for name, on_bundle in bundles(config, roles).items():
        specs = []
        for sharing in on_bundle.values():
            spec = {"CPU": config.cpus_per_role}
            if config.gpus_per_role:
                spec["GPU"] = config.gpus_per_role
            custom = config.roles_on_nodes.get(sharing[0].pinned_as) if sharing else None
            if custom:
                spec[custom] = 0.001
            specs.append(spec)
        group = placement_group(specs, strategy=config.strategy, name=f"ferrule-{name}")
        made.append(group)
        for index, sharing in on_bundle.items():
            share = len(sharing)
            for role in sharing:
                custom = config.roles_on_nodes.get(role.pinned_as)
                options[role] = dict(
                    num_cpus=config.cpus_per_role / share,
                    num_gpus=config.gpus_per_role / share,
                    resources={custom: 0.001 / share} if custom else {},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=index
                    ),
                )
    ready = [group.ready() for group in made]
    _, waiting = ray.wait(ready, num_returns=len(ready), timeout=60)
    if waiting:
        names = [g.bundle_specs for g, r in zip(made, ready, strict=True) if r in waiting]
        raise RunError(
            f"Ray could not place {len(waiting)} placement group(s) within 60 s: bundles "
            f"{names} do not fit the cluster's resources {ray.cluster_resources()}; lower "
            "[ray] cpus_per_role / gpus_per_role or add nodes"
        )
    return options, made
