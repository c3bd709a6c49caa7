"""Ray: start or join a cluster, and place the roles with placement groups.

    start_ray(config.ray)                          # local cluster, or join config.ray.address
    places, groups = place_roles(config.ray, ["policy-0", "reference", "rollout-0"])
    ray.remote(PolicyWorker).options(**places["policy-0"]).remote()

Placements ([ray] placement):
- "colocate_all": one placement group of one bundle; every role takes a share of it (on GPUs,
  every role on the same devices).
- "colocate": the policy's ranks with its reference in one group (a bundle per rank, the
  reference on rank 0's), the critic in another, the rollout engines in a third (a bundle per
  engine); the groups' bundles are PACKed by default.
- "separate": every role in a placement group of its own.
`roles_on_nodes` adds a custom node resource to a role's bundle, which pins it to that node.
"""

import os

from ferrule_launcher.config import RayConfig
from ferrule_launcher.workers import CPU_ENV


def start_ray(config: RayConfig, env: dict[str, str]) -> str:
    """ray.init: a local cluster (no dashboard) or the one at `config.address`."""
    import ray

    runtime_env = {"env_vars": env}
    if config.address:
        ray.init(address=config.address, runtime_env=runtime_env, log_to_driver=False)
        return "joined " + config.address
    num_cpus = config.num_cpus or os.cpu_count() or 1
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=runtime_env,
    )
    return f"local cluster ({num_cpus} CPUs)"


def role_env() -> dict[str, str]:
    """Environment for every role's process: the CPU settings on machines without CUDA."""
    env = {}
    if not _has_cuda():
        env.update(CPU_ENV)
    for key in ("FERRULE_CACHE", "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _has_cuda() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def kind_of(role: str) -> str:
    """ "policy-1" -> "policy", "rollout-0" -> "rollout"; the kind names roles_on_nodes uses."""
    base = role.split("-")[0]
    return "policy" if base == "reference" else base


def groups_for(placement: str, roles: list[str]) -> dict[str, list[str]]:
    """Which roles share a placement group: {group name: [roles]}."""
    if placement == "colocate_all":
        return {"all": list(roles)}
    if placement == "separate":
        return {role: [role] for role in roles}
    groups: dict[str, list[str]] = {}
    for role in roles:  # colocate: the reference joins the policy's group
        groups.setdefault(kind_of(role), []).append(role)
    return groups


def bundle_of(placement: str, role: str) -> int:
    """The bundle a role takes in its group: one per policy rank or rollout engine, the
    reference with policy rank 0; everything in bundle 0 when colocating all."""
    if placement == "colocate_all" or "-" not in role:
        return 0
    return int(role.rsplit("-", 1)[1])


def node_resource(config: RayConfig, role: str) -> str | None:
    return config.roles_on_nodes.get(kind_of(role))


def place_roles(config: RayConfig, roles: list[str]) -> tuple[dict[str, dict], list]:
    """Ray actor options per role (placement group, bundle, resources) and the groups made.

    Roles on one bundle share it: each asks for its share of the bundle's CPUs / GPUs, so a
    bundle is as large as one role's request however many share it (they time-share a device).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options, made = {}, []
    for name, members in groups_for(config.placement, roles).items():
        on_bundle: dict[int, list[str]] = {}
        for role in members:
            index = bundle_of(config.placement, role) if len(members) > 1 else 0
            on_bundle.setdefault(index, []).append(role)
        bundles = []
        for index in range(max(on_bundle) + 1):
            bundle = {"CPU": config.cpus_per_role}
            if config.gpus_per_role:
                bundle["GPU"] = config.gpus_per_role
            custom = node_resource(config, on_bundle.get(index, members)[0])
            if custom:
                bundle[custom] = 0.001
            bundles.append(bundle)
        group = placement_group(bundles, strategy=config.strategy, name=f"ferrule-{name}")
        made.append(group)
        for index, sharing in on_bundle.items():
            share = len(sharing)
            for role in sharing:
                custom = node_resource(config, role)
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
        raise RuntimeError(
            f"Ray could not place {len(waiting)} placement group(s) within 60 s: bundles "
            f"{names} do not fit the cluster's resources {ray.cluster_resources()}; lower "
            "[ray] cpus_per_role / gpus_per_role or add nodes"
        )
    return options, made
