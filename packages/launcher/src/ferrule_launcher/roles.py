"""Start the run's actors and open the weight sync between them.

    roles = start_roles(setup, places, groups, env)  # Roles: policy ranks, engines, reference...
    write_roles(out / "roles.json", roles, rewards)  # where each one runs
    roles.stop()

The rollout engine is ferrule-rollout's class, made a Ray actor here, at the call site. The
policy, the reference and the critic each run as a group of data-parallel ranks (`RankWorker`,
a wrapper around ferrule-trainer's `Actor` / `Critic`). Each group joins its own process group
(its own ZeRO world), and the policy's weight sender lives in the process that holds the
weights. The run waits for every role before it goes on, so a role that cannot start is named.
"""

import json
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ferrule_launcher.calls import RankGroup, get, get_each
from ferrule_launcher.placement import Role

if TYPE_CHECKING:
    from collections.abc import Callable

    from ferrule_trainer import Batch, EpochPlan, ForwardPlan


def _timed(train: "Callable[[], dict]") -> dict:
    """`train()`'s metrics plus this rank's cost: the "seconds" it took, and "compiles", the
    graphs torch.compile built meanwhile. A compile happens when a compiled layer meets an input
    of a new form; each takes seconds at real sizes, and every other rank waits for it at the
    next collective."""
    import time

    from torch._dynamo.utils import counters

    began, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
    metrics = train()
    metrics["seconds"] = time.perf_counter() - began
    metrics["compiles"] = counters["stats"]["unique_graphs"] - graphs
    return metrics


class RankWorker:
    """One data-parallel rank of the policy, the reference or the critic. It holds
    ferrule-trainer's `Actor` (trained, or frozen for the reference) or `Critic`, and on the
    policy also the weightsync sender next to the weights. `setup` joins the group's process
    group, so the driver creates every rank of a group first and then sets them up together."""

    def __init__(self):
        self.actor = None
        self.sender = None
        self.in_place = False  # whether the sender may let engines read the weights in place

    def setup(
        self, kind: str, model_path: str, rank: int, world: int, master: str, port: int, **options
    ) -> dict[str, float]:
        """Build this rank's model. Returns its start-up seconds by phase (the model's
        `startup_seconds`, with this rank's import of the trainer added to "imports")."""
        import time

        began = time.perf_counter()
        from ferrule_trainer import Actor, Critic

        imported = time.perf_counter() - began
        # Read by ferrule-trainer's init_distributed (torch.distributed's env:// rendezvous).
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(world),
            MASTER_ADDR=master,
            MASTER_PORT=str(port),
        )
        if kind == "critic":
            self.actor = Critic(model_path, **options)
        else:
            self.actor = Actor(model_path, train=kind == "policy", **options)
        seconds = self.actor.startup_seconds()
        seconds["imports"] = round(seconds.get("imports", 0.0) + imported, 2)
        return seconds

    def where(self) -> dict:
        """This node's address and a free port on it (for process groups)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"host": ray.util.get_node_ip_address(), "port": port}

    def open_sender(
        self,
        transport: str,
        host: str,
        port: int,
        num_receivers: int,
        secret: str,
        in_place: bool = False,
    ) -> str:
        """Open a weight-sync group with this rank as the sender, on this rank's device: NCCL
        broadcast or CUDA IPC on a GPU, gloo or shared memory on CPU ("host": shared memory
        wherever the weights are). Returns the device once every receiver has joined, each
        proving it holds `secret`. `in_place`: CUDA IPC may let the engines read the weights
        where they lie (not with an offload between phases, as the engines' mappings would keep
        that memory)."""
        from ferrule_weightsync import create_sender

        self.close_weight_sync()  # a group takes no new members: a replaced engine needs a new one
        device = "cpu" if transport == "host" else self.actor.device
        transport = "ipc" if transport == "host" else transport
        self.sender = create_sender(
            transport,
            host,
            port,
            num_receivers,
            device=device,
            timeout=300.0,
            connect_timeout=600.0,
            secret=secret,
        )
        self.in_place = in_place
        return str(device)

    def close_weight_sync(self) -> None:
        """Leave this rank's weight-sync group (its receivers see at once that it is gone)."""
        if self.sender is not None:
            # Engines receive only when told to, never at a close: waiting for them to read
            # the end of the stream would only delay a stop or an engine's replacement.
            self.sender.close(timeout=0)
            self.sender = None

    def abort_weight_sync(self, reason: str) -> None:
        """Runs in the "control" concurrency group, while `send_weights` may be blocked on a
        receiver that died; the blocked send then raises at once with `reason`."""
        if self.sender is not None:
            self.sender.abort(reason)

    def send_weights(self, version: int) -> int:
        """Ranks with a sender export the weights and send them; the other ranks only take part
        in the ZeRO-3 gathers."""
        if self.sender is None:
            self.actor.take_part_in_export()
            return version
        weights = self.actor.export_weights()
        specs, in_place = self.actor.weight_specs(), self.in_place and self.actor.export_in_place()
        # in place: the engines read the weights where they lie (CUDA IPC, no packing copy);
        # nothing here changes the weights before `send` returns
        return self.sender.send(weights, version=version, specs=specs, in_place=in_place)

    def warm_up(self, tokens: int, packed: bool, entropy: bool, score: bool) -> float:
        """Run the Actor's passes on a made-up batch when its layers are compiled, so that they
        compile now. Returns 0.0 when they are not compiled, or for a critic."""
        if not hasattr(self.actor, "warm_up") or not self.actor.compiled:
            return 0.0
        return self.actor.warm_up(tokens, packed, entropy, score)

    def logprobs(self, batch: "Batch", plan: "ForwardPlan", temperature: float | None = None):
        return self.actor.logprobs(batch, plan, temperature)

    def values(self, batch: "Batch", plan: "ForwardPlan"):
        return self.actor.values(batch, plan)

    def train_epochs(self, batch: "Batch", plan: "EpochPlan", loss) -> dict:
        return _timed(lambda: self.actor.train_epochs(batch, plan, loss))

    def likelihood_epochs(self, batch: "Batch", plan: "EpochPlan") -> dict:
        return _timed(lambda: self.actor.likelihood_epochs(batch, plan))

    def preference_epochs(self, batch: "Batch", plan: "EpochPlan", loss) -> dict:
        return _timed(lambda: self.actor.preference_epochs(batch, plan, loss))

    def save(self, directory: str, step: int) -> dict[str, float]:
        """Save this rank's resumable state; returns the seconds by part (checkpoint.SavedState)."""
        return self.actor.save_state(directory, step=step).seconds

    def load(self, directory: str, step: int) -> int:
        return int(self.actor.load_state(directory, tag=f"step{step}")["step"])

    def save_hf(self, path: str) -> None:
        self.actor.save_hf(path)

    def device_memory(self) -> float:
        """GB in use on this rank's GPU by every process (0 on CPU), i.e. what the roles sharing
        the GPU hold at this moment."""
        import torch

        if self.actor.device.type != "cuda":
            return 0.0
        free, total = torch.cuda.mem_get_info(self.actor.device)
        return (total - free) / 1e9

    def weights_digest(self) -> str:
        return self.actor.weights_digest()

    def offload(self) -> None:
        self.actor.offload()

    def reload(self) -> None:
        self.actor.reload()

    def release_cache(self) -> None:
        self.actor.release_cache()


@dataclass(frozen=True)
class WeightSync:
    """How the policy's weights reach the engines ([rollout] transport, "auto" resolved)."""

    transport: str
    """ "broadcast" (NCCL / gloo from rank 0), "ipc" (CUDA IPC / shared memory, colocated) or
    "host" (shared memory wherever the weights are)."""
    receivers_per_engine: int = 1
    """Weight-sync receivers in each engine: one per worker, so [rollout] tensor_parallel_size."""
    in_place: bool = True
    """Whether CUDA IPC may let the engines read the weights where they lie. It is off with an
    offload between phases, because the engines' mappings would keep that memory."""


@dataclass(frozen=True)
class RoleSetup:
    """What the run's actors are started with (run.py builds it from the config)."""

    model_path: str
    policy: dict
    """`Actor`'s keyword arguments on every policy rank."""
    reference: dict
    """`Actor(train=False)`'s keyword arguments on every reference rank."""
    engine_class: type
    engine: dict
    """The rollout engine's keyword arguments, besides the model path and the seed."""
    seed: int
    """Engine i's seed is seed + i."""
    weight_sync: WeightSync
    critic: dict | None = None
    """`Critic`'s keyword arguments on every critic rank (None: no critic)."""
    critic_path: str | None = None
    """Where the critic starts from (None: the model path)."""


@dataclass
class Roles:
    policy: RankGroup
    engines: list
    reference: RankGroup | None = None
    critic: RankGroup | None = None
    groups: list = field(default_factory=list)  # Ray placement groups, given back at the end
    start_engine: Callable | None = None  # index -> a new engine actor on that engine's bundle
    weight_sync: WeightSync | None = None  # what `open_weight_sync` reopens the sync with

    def handles(self) -> dict[Role, object]:
        """Every actor of the run by its role."""
        found = {}
        for kind, group in (("policy", self.policy), ("reference", self.reference)):
            if group is not None:
                found.update({Role(kind, i): w for i, w in enumerate(group.workers)})
        if self.critic is not None:
            found.update({Role("critic", i): w for i, w in enumerate(self.critic.workers)})
        found.update({Role("rollout", i): e for i, e in enumerate(self.engines)})
        return found

    def stop(self) -> None:
        import ray

        # A sender removes its shared-memory segments (CPU IPC) when it closes; a killed sender
        # leaves them to the next sender's sweep. A sender still busy (a send blocked on a dead
        # engine) is not waited for.
        closing = [worker.close_weight_sync.remote() for worker in self.policy.workers]
        ray.wait(closing, num_returns=len(closing), timeout=2.0)
        for actor in self.handles().values():
            ray.kill(actor, no_restart=True)
        for group in self.groups:  # on a shared cluster, give the resources back at once
            ray.util.remove_placement_group(group)


def start_roles(
    setup: RoleSetup,
    places: dict[Role, dict],
    groups: list,
    env: dict,
    ready: dict | None = None,
    phases: dict | None = None,
) -> Roles:
    """Start every role of `places` and wait for them, then open the weight sync. `places` comes
    from `placement.place_roles` (each role's Ray options); `groups` are their placement groups,
    given back by `Roles.stop`. Every actor is created before any is waited for, so their
    processes start at the same time. `ready` receives {role: seconds from this call's start
    until the role was ready}. `phases` receives {role: {phase: seconds}}: first "process", the
    rest of the role's wait (Ray starting its process, or a rank's call waiting for its group's
    first process to say where the group meets), then what the role timed itself ("imports",
    "weights", ...)."""
    import time

    began, arrivals = time.monotonic(), {}
    launch = _Launcher(setup, places, env)
    roles = Roles(RankGroup([], "policy"), [], groups=groups, weight_sync=setup.weight_sync)
    roles.start_engine = launch.engine
    try:
        started = {}
        for kind in ("policy", "reference", "critic"):
            started[kind] = ranks, workers = launch.ranks(kind)
            if ranks or kind == "policy":  # in `roles` at once, so `roles.stop()` kills them
                options = getattr(setup, kind) or {}
                shared = options.get("sequence_parallel", 1)
                setattr(roles, kind, RankGroup(workers, kind, shared))
        engines = sum(role.kind == "rollout" for role in places)
        roles.engines = [launch.engine(i) for i in range(engines)]
        # Every process is starting now. A group's ranks set up once rank 0 of the group says
        # where the group meets; an engine answers once its constructor is done.
        starts = [
            (e.startup_seconds.remote(), Role("rollout", i).label)
            for i, e in enumerate(roles.engines)
        ]
        for kind, (ranks, workers) in started.items():
            starts += launch.set_up(kind, ranks, workers)
        # Wait for every role to start, naming the one that could not.
        results = get_each(starts, arrivals=arrivals)
        timed = {role: seconds for (_, role), seconds in zip(starts, results, strict=True)}
        _record_start(timed, arrivals, began, ready, phases)
        open_weight_sync(setup.weight_sync, roles.policy.workers, roles.engines)
    except BaseException:
        roles.stop()
        raise
    return roles


class _Launcher:
    """Creates the run's actors on their places (Ray options and the roles' environment)."""

    def __init__(self, setup: RoleSetup, places: dict[Role, dict], env: dict):
        self.setup, self.places, self.env = setup, places, env

    def actor(self, cls, role: Role, concurrency_groups=None, **extra):
        import ray

        remote = (
            ray.remote(concurrency_groups=concurrency_groups) if concurrency_groups else ray.remote
        )
        # a runtime_env in the role's placement (placement.with_threads) replaces the shared one
        options = {"runtime_env": {"env_vars": self.env}, **self.places[role], **extra}
        return remote(cls).options(**options)

    def engine(self, index: int):
        """Rollout engine `index` on its bundle (also how a dead engine is replaced)."""
        s = self.setup
        engine = self.actor(s.engine_class, Role("rollout", index), max_concurrency=4)
        return engine.remote(s.model_path, seed=s.seed + index, **s.engine)

    def ranks(self, kind: str) -> tuple[list[Role], list]:
        """The ranks of `kind` and a new `RankWorker` for each (none set up yet)."""
        ranks = sorted(role for role in self.places if role.kind == kind)
        # "control": abort_weight_sync runs while send_weights blocks the default group
        workers = [
            self.actor(RankWorker, role, concurrency_groups={"control": 1}).remote()
            for role in ranks
        ]
        return ranks, workers

    def set_up(self, kind: str, ranks: list[Role], workers: list) -> list[tuple]:
        """Start each rank's set-up call; returns (ref, label) pairs. The ranks meet at the
        address rank 0 gives."""
        if not workers:
            return []
        s = self.setup
        options = {"policy": s.policy, "reference": s.reference, "critic": s.critic}[kind]
        path = (s.critic_path or s.model_path) if kind == "critic" else s.model_path
        master = get(workers[0].where.remote(), ranks[0].label)
        return [
            (
                worker.setup.remote(
                    kind, path, i, len(workers), master["host"], master["port"], **options
                ),
                ranks[i].label,
            )
            for i, worker in enumerate(workers)
        ]


def _record_start(timed: dict, arrivals: dict, began: float, ready, phases) -> None:
    """Record in `ready` each role's seconds from the start until it was ready, and in `phases`
    the phases the role timed itself, after "process": the rest of its wait."""
    for role, when in sorted(arrivals.items(), key=lambda item: item[1]):
        took, seconds = when - began, timed[role]
        if ready is not None:
            ready[role] = round(took, 1)
        if phases is not None:
            rest = max(took - sum(seconds.values()), 0.0)
            phases[role] = {k: round(v, 1) for k, v in {"process": rest, **seconds}.items()}


def open_weight_sync(sync: WeightSync, workers: list, engines: list) -> None:
    """Open weight-sync groups from the policy to every engine. "broadcast" (NCCL / gloo): rank
    0 sends to every engine. "ipc" (CUDA IPC / shared memory, colocated): engine i receives from
    policy rank i mod ranks, the rank on its own bundle, so each GPU's weights stay on that GPU.
    An engine with tensor parallelism is `receivers_per_engine` receivers, one per worker. Each
    group has a fresh secret, handed to its members through Ray: a process that reaches the
    group's store but is not a member cannot join the group or forge its messages."""
    transport, per_engine = sync.transport, sync.receivers_per_engine
    senders = len(workers) if transport in ("ipc", "host") else 1
    receiving = "ipc" if transport == "host" else transport  # a receiver maps what it is sent
    calls = []
    for rank in range(senders):
        members = [(i, e) for i, e in enumerate(engines) if i % senders == rank]
        if not members:
            continue
        here = get(workers[rank].where.remote(), Role("policy", rank).label)
        receivers = len(members) * per_engine
        secret = secrets.token_hex(32)
        calls.append(
            (
                workers[rank].open_sender.remote(
                    transport, here["host"], here["port"], receivers, secret, sync.in_place
                ),
                f"policy rank {rank} (weight sync sender)",
            )
        )
        calls += [
            (
                e.init_weight_sync.remote(
                    receiving,
                    here["host"],
                    here["port"],
                    1 + j * per_engine,
                    receivers,
                    secret=secret,
                ),
                f"rollout engine {i} (weight sync receiver)",
            )
            for j, (i, e) in enumerate(members)
        ]
    get_each(calls)


def _whereabouts(self) -> dict:  # runs inside an actor, through __ray_call__
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "node_ip": ray.util.get_node_ip_address(),
        "gpus": [str(gpu) for gpu in ray.get_gpu_ids()],  # Ray's ids of the GPUs it holds
    }


def write_roles(path: Path, roles: Roles, rewards) -> None:
    """Write which node and process each role runs in (for people, and for the placement
    tests). `rewards` is the RewardService, or None when the run has none."""
    where = {
        role.name: get(handle.__ray_call__.remote(_whereabouts), role.label)
        for role, handle in roles.handles().items()
    }
    if rewards is not None and (server := rewards.where()) is not None:
        where["rewards"] = server
    staged = path.with_suffix(".tmp")  # rewritten when an engine is replaced: never half-written
    staged.write_text(json.dumps(where, indent=2) + "\n")
    staged.replace(path)
