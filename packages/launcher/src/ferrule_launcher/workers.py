"""The plain classes that run inside Ray actors; the launcher applies ray.remote at the call site.

    policy = ray.remote(PolicyWorker).options(num_cpus=0.5).remote()   # then .setup(...)
    engine = ray.remote(RolloutEngine).options(...).remote(path, dtype="float32")   # directly
    reference = ray.remote(Actor).options(...).remote(path, train=False)            # directly

The rollout engine, the reference `Actor` and the `Critic` are the component packages' classes,
used as they are. Only the policy needs a wrapper: its weight sender must live in the process
that holds the weights, and its PPO epochs loop over mini-batches of one rollout batch.
"""

import os
import socket

# Set in every role's process (Ray runtime_env) before vLLM or DeepSpeed are imported.
CPU_ENV = {
    "DS_ACCELERATOR": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def node_address() -> str:
    """This process's node IP as Ray knows it (127.0.0.1 outside Ray)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
        """Node, pid and a free port here, for the weight-sync group and for placement tests."""
        import ray

        return {
            "host": node_address(),
            "port": free_port(),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

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

    def train(
        self,
        batch: dict,
        *,
        epochs: int,
        mini_batches: int,
        micro_batch_size: int,
        **loss_options,
    ) -> dict:
        """PPO epochs over the rollout batch: `mini_batches` optimizer steps per epoch."""
        from ferrule_launcher.batch import split

        rows = batch["input_ids"].shape[0]
        size = rows // mini_batches
        metrics: dict[str, float] = {}
        steps = 0
        for _ in range(epochs):
            for mini in split(batch, size):
                result = self.actor.train_step(split(mini, micro_batch_size), **loss_options)
                for key, value in result.items():
                    metrics[key] = metrics.get(key, 0.0) + value
                steps += 1
        return {key: value / steps for key, value in metrics.items()}

    def save(self, directory: str, step: int) -> None:
        self.actor.save_state(directory, step=step)

    def load(self, directory: str, step: int) -> int:
        return int(self.actor.load_state(directory, tag=f"step{step}")["step"])

    def save_hf(self, path: str) -> None:
        self.actor.save_hf(path)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def run_sft(
    model_path: str,
    data_path: str,
    out_dir: str,
    steps: int,
    batch_size: int,
    learning_rate: float,
    dtype: str,
    seed: int,
) -> str:
    """The SFT warm start with ferrule-trainer's SFT (resumable); returns the model folder."""
    from ferrule_trainer import sft

    config = sft.SFTConfig(
        model=sft.ModelConfig(path=model_path, dtype=dtype, zero_stage=0),
        data=sft.DataConfig(path=data_path, max_length=128),
        train=sft.TrainConfig(
            epochs=1,
            batch_size=batch_size,
            micro_batch_size=batch_size,
            learning_rate=learning_rate,
            max_steps=steps,
            seed=seed,
        ),
        output=sft.OutputConfig(dir=out_dir, save_every=max(steps // 2, 1), resume=True),
    )
    sft.train(config, log=lambda line: None)
    return os.path.join(out_dir, "model")
