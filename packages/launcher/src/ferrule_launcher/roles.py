"""Start the run's actors and open the weight sync between them.

    roles = start_roles(config, model_path, env)    # Roles: policy ranks, engines, reference...
    write_roles(out / "roles.json", roles, rewards)  # where each one runs
    roles.stop()

The rollout engine, the reference `Actor` and the `Critic` are the component packages' classes,
made Ray actors here, at the call site. Only the policy needs a wrapper (`PolicyWorker`): its
ranks join one process group, and its weight sender must live in the process that holds the
weights. Every role is waited for before the run goes on, so one that cannot start is named.
"""

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ferrule_launcher.calls import PolicyGroup, get, get_each
from ferrule_launcher.config import Config
from ferrule_launcher.placement import Role, place_roles


class PolicyWorker:
    """One data-parallel rank of the trained policy: ferrule-trainer's Actor, plus (on rank 0)
    the weightsync sender next to the weights. `setup` joins the ranks' process group, so the
    driver creates every rank first and then sets them up together."""

    def __init__(self):
        self.actor = None
        self.sender = None

    def setup(
        self, model_path: str, rank: int, world: int, master: str, port: int, **actor_options
    ) -> None:
        from ferrule_trainer.actor import Actor

        # Read by ferrule-trainer's init_distributed (torch.distributed's env:// rendezvous).
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(world),
            MASTER_ADDR=master,
            MASTER_PORT=str(port),
        )
        self.actor = Actor(model_path, train=True, **actor_options)

    def where(self) -> dict:
        """This node's address and a free port on it (for process groups)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"host": ray.util.get_node_ip_address(), "port": port}

    def open_sender(self, transport: str, host: str, port: int, num_receivers: int) -> None:
        """Start the weight-sync group as its sender (returns once every receiver joined)."""
        from ferrule_weightsync import create_sender

        self.sender = create_sender(
            transport, host, port, num_receivers, timeout=300.0, connect_timeout=600.0
        )

    def send_weights(self, version: int) -> int:
        """Every rank exports (ZeRO-3 gathers need all of them); rank 0 sends."""
        weights = self.actor.export_weights()
        if self.sender is None:
            for _ in weights:
                pass
            return version
        return self.sender.send(weights, version=version, specs=self.actor.weight_specs())

    def logprobs(self, batch: dict):
        return self.actor.logprobs(batch)

    def train_epochs(self, batch: dict, **options) -> dict:
        return self.actor.train_epochs(batch, **options)

    def save(self, directory: str, step: int) -> None:
        self.actor.save_state(directory, step=step)

    def load(self, directory: str, step: int) -> int:
        return int(self.actor.load_state(directory, tag=f"step{step}")["step"])

    def save_hf(self, path: str) -> None:
        self.actor.save_hf(path)


@dataclass
class Roles:
    policy: PolicyGroup
    engines: list
    reference: object = None
    critic: object = None
    groups: list = field(default_factory=list)  # Ray placement groups, given back at the end

    def handles(self) -> dict[Role, object]:
        """Every actor of the run by its role."""
        found = {Role("policy", i): w for i, w in enumerate(self.policy.workers)}
        for kind, handle in (("reference", self.reference), ("critic", self.critic)):
            if handle is not None:
                found[Role(kind)] = handle
        found.update({Role("rollout", i): e for i, e in enumerate(self.engines)})
        return found

    def stop(self) -> None:
        import ray

        for actor in self.handles().values():
            ray.kill(actor, no_restart=True)
        for group in self.groups:  # on a shared cluster, give the resources back at once
            ray.util.remove_placement_group(group)


def start_roles(config: Config, model_path: str, env: dict) -> Roles:
    """Every actor of the run, started, placed and waited for; the weight sync opened."""
    import ray

    from ferrule_rollout.engine import RolloutEngine
    from ferrule_trainer.actor import Actor
    from ferrule_trainer.critic import Critic

    t, r, dtype, seed = config.trainer, config.rollout, config.model.dtype, config.loop.seed
    wanted = [Role("policy", i) for i in range(t.ranks)]
    wanted += [Role("reference")] if t.kl_coef > 0 else []
    wanted += [Role("critic")] if config.critic is not None else []
    wanted += [Role("rollout", i) for i in range(r.engines)]
    options, groups = place_roles(config.ray, wanted)
    roles = Roles(PolicyGroup([]), [], groups=groups)  # filled in as they start, for stop()

    def actor(cls, role: Role, **extra):
        return ray.remote(cls).options(**options[role], runtime_env={"env_vars": env}, **extra)

    try:
        workers = [actor(PolicyWorker, Role("policy", i)).remote() for i in range(t.ranks)]
        roles.policy.workers = workers
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
                seed=seed,
            )
            for i, w in enumerate(workers)
        ]
        if Role("reference") in options:
            roles.reference = actor(Actor, Role("reference")).remote(
                model_path,
                train=False,
                zero_stage=t.zero_stage,
                dtype=dtype,
                temperature=r.temperature,
                seed=seed,
            )
        if Role("critic") in options:
            roles.critic = actor(Critic, Role("critic")).remote(
                model_path,
                zero_stage=t.zero_stage,
                dtype=dtype,
                learning_rate=config.critic.learning_rate,
                max_grad_norm=t.max_grad_norm,
                seed=seed,
            )
        roles.engines = [
            actor(RolloutEngine, Role("rollout", i), max_concurrency=4).remote(
                model_path, dtype=dtype, seed=seed + i, **r.engine_options()
            )
            for i in range(r.engines)
        ]
        # Wait for every role to start, naming the one that could not.
        get_each([(ref, Role("policy", i).label) for i, ref in enumerate(setups)])
        get_each([(h.__ray_ready__.remote(), role.label) for role, h in roles.handles().items()])
        open_weight_sync(config, workers[0], roles.engines)
    except BaseException:
        roles.stop()
        raise
    return roles


def open_weight_sync(config: Config, policy, engines: list) -> None:
    """The policy's rank 0 sends, every engine receives: CUDA IPC / shared memory when all
    roles share one bundle, NCCL / gloo broadcast otherwise (`[rollout] transport`)."""
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


def _whereabouts(self) -> dict:  # runs inside an actor, through __ray_call__
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "node_ip": ray.util.get_node_ip_address(),
    }


def write_roles(path: Path, roles: Roles, rewards) -> None:
    """Which node and process each role runs in (for people, and for the placement tests)."""
    where = {
        role.name: get(handle.__ray_call__.remote(_whereabouts), role.label)
        for role, handle in roles.handles().items()
    }
    if rewards.process is not None:
        where["rewards"] = {"pid": rewards.process.pid, "address": rewards.addresses[0]}
    path.write_text(json.dumps(where, indent=2) + "\n")
