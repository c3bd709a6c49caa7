"""A reward model's server as a Ray role: ferrule-rewards' model backend on a device of its own.

    server = RewardModelRole.start(config.rewards, config.ray, out)   # placed by Ray, serving
    RewardClient([server.address], token=server.token)                # what RewardService does
    server.dead(); server.where(); server.stop()

The role asks Ray for [rewards] gpus / cpus (default: [ray] gpus_per_role / cpus_per_role),
outside the run's placement groups, so the reward model never shares a GPU with the driver or
a policy rank. Inside the role, ferrule-rewards' gRPC server runs its model backend on the
device Ray gave the role. On the driver's node the server listens on loopback; on another node
it listens on that node's address. Either way it requires a fresh per-run bearer token (sent in
plaintext inside the cluster, like Ray's own traffic). Ray does not restart the role:
RewardService restarts it within [rewards] max_restarts, as it does a server process.
"""

import contextlib
import secrets
from functools import partial
from pathlib import Path

from ferrule_launcher.calls import ActorDied, get
from ferrule_launcher.config import RayConfig, RewardsConfig

PROBE_SECONDS = 30.0  # the actor answers at once: the server runs in its own thread


class RewardModelServer:
    """The Ray actor: ferrule-rewards' server with its model backend, in this process."""

    def __init__(
        self, model: str, options: dict, token: str, driver_node: str, log: str, first: bool
    ):
        import logging

        import ray

        from ferrule_rewards.model import ModelScorer
        from ferrule_rewards.server import BackgroundServer

        context = ray.get_runtime_context()
        on_driver_node = context.get_node_id() == driver_node
        if on_driver_node:  # the run's folder is on this node: put the log beside the others
            handler = logging.FileHandler(log, mode="w" if first else "a")
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            logging.getLogger("ferrule_rewards").addHandler(handler)
            logging.getLogger("ferrule_rewards").setLevel(logging.INFO)
        host = "127.0.0.1" if on_driver_node else ray.util.get_node_ip_address()
        bind = f"[{host}]:0" if ":" in host else f"{host}:0"
        scorer = partial(ModelScorer, model, **options)  # normalize, batch_tokens
        self.server = BackgroundServer(scorer, bind, token=token)
        logging.getLogger("ferrule_rewards").info(
            "serving the reward model %s on %s (Ray node %s)", model, self.server.address, host
        )

    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.server.stop(grace=2.0)


class RewardModelRole:
    """The driver's handle on a started RewardModelServer actor."""

    def __init__(self, actor, address: str, token: str):
        self.actor, self.address, self.token = actor, address, token

    @classmethod
    def start(
        cls, config: RewardsConfig, ray_config: RayConfig, out: Path, first: bool = True
    ) -> "RewardModelRole":
        """Place the actor, wait for its server to serve ([rewards] start_timeout), and return
        the handle. A RunError says what failed (the model, the resources). `first` is False for
        a restart, which appends to out/rewards.log instead of starting it afresh."""
        import ray

        from ferrule_launcher.calls import RunError

        gpus, cpus = resources(config, ray_config)
        pin = ray_config.roles_on_nodes.get("rewards")
        token = secrets.token_urlsafe(32)
        actor = (
            ray.remote(RewardModelServer)
            .options(
                num_gpus=gpus,
                num_cpus=cpus,
                resources={pin: 0.001} if pin else {},
                max_restarts=0,
                max_concurrency=2,  # a free slot, so stop() can run while address() waits
            )
            .remote(
                str(config.model),
                dict(normalize=config.normalize, batch_tokens=config.model_batch_tokens),
                token,
                ray.get_runtime_context().get_node_id(),
                str(out / "rewards.log"),
                first,
            )
        )
        address = actor.address.remote()
        ready, _ = ray.wait([address], timeout=config.start_timeout)
        if not ready:
            ray.kill(actor)
            raise RunError(
                f"[rewards] the reward model's Ray role did not serve within "
                f"{config.start_timeout:g} s (start_timeout; it asks for {gpus:g} GPUs and "
                f"{cpus:g} CPUs: [rewards] gpus / cpus; the cluster has "
                f"{ray.cluster_resources()})"
            )
        try:
            return cls(actor, get(address, "the reward model's role"), token)
        except ActorDied as died:
            raise RunError(
                f"[rewards] the reward model {config.model} did not load: {died}"
            ) from None

    def dead(self) -> bool:
        """Whether the actor is gone (killed, out of memory, its node lost)."""
        import ray

        probe = self.actor.__ray_ready__.remote()
        ready, _ = ray.wait([probe], timeout=PROBE_SECONDS)
        if not ready:
            return False  # alive but slow to answer; its next calls will say more
        try:
            ray.get(probe)
        except ray.exceptions.RayActorError:
            return True
        return False

    def describe(self) -> str:
        return "the reward model's Ray role"

    def how_it_ended(self) -> str:
        return "died (its Ray actor is gone)"

    def where(self) -> dict:
        from ferrule_launcher.roles import _whereabouts

        where = get(self.actor.__ray_call__.remote(_whereabouts), "the reward model's role")
        return {**where, "address": self.address}

    def stop(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # the actor may be gone already
            ray.get(self.actor.stop.remote(), timeout=10)
        ray.kill(self.actor)


def resources(config: RewardsConfig, ray_config: RayConfig) -> tuple[float, float]:
    """(GPUs, CPUs) the reward model's role asks for."""
    gpus = ray_config.gpus_per_role if config.gpus is None else config.gpus
    cpus = ray_config.cpus_per_role if config.cpus is None else config.cpus
    return gpus, cpus
