"""The worker side of a weight update: a vLLM `WeightTransferEngine` backed by ferrule-weightsync.

vLLM 0.32 drives weight updates through a registered `WeightTransferEngine` in every worker:
`init_transfer_engine` (once), then per update `start_weight_update`, `update_weights`,
`finish_weight_update`. FerruleWeightTransferEngine opens a ferrule-weightsync receiver (gloo
broadcast or shared memory on CPU, NCCL or CUDA IPC on GPU). It loads what arrives through vLLM's
layerwise reload path, because that path works on every platform: plain `load_weights` after
start-up fails on CPU, whose backend repacks linear weights. The `vllm.general_plugins` entry
point `register` (see pyproject.toml) registers the engine under the backend name "ferrule" in
each vLLM process, so tensor-parallel workers in their own processes find it too.
`vllm_engine.VLLMEngine` drives it.
"""

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.logger import init_logger

from ferrule_rollout.joining import Joining

BACKEND = "ferrule"
logger = init_logger(__name__)


@dataclass
class FerruleInitInfo(WeightTransferInitInfo):
    """Where the weight-sync group is and which receiver ranks this engine's workers take."""

    transport: str
    """"broadcast" (NCCL / gloo) or "ipc" (CUDA IPC / shared memory)."""
    host: str
    port: int
    rank: int
    """Receiver rank of this engine's first worker; worker w takes rank + w."""
    num_receivers: int
    """Receivers in the whole group (every worker of every engine)."""
    timeout: float = 300.0
    """Seconds any step may wait for a peer before failing with a timeout error."""
    secret: str | None = None
    """The group's shared secret, when the sender has one."""


@dataclass
class FerruleUpdateInfo(WeightTransferUpdateInfo):
    timeout: float | None = None
    """Seconds to wait for the sender to start the update (None: as long as it lives)."""


class FerruleWeightTransferEngine(WeightTransferEngine[FerruleInitInfo, FerruleUpdateInfo]):
    init_info_cls = FerruleInitInfo
    update_info_cls = FerruleUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.receiver = None
        self.joining: Joining | None = None  # a join still waiting for its peers
        self.group = ""  # the group joined or being joined, for the log
        self.version = 0  # version of the last update loaded into this worker
        self.touched = False  # the current update has begun to replace weights

    def init_transfer_engine(self, init_info: FerruleInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        from ferrule_weightsync import create_receiver

        if self.receiver is not None or self.joining is not None:
            raise RuntimeError("this engine already joined a weight-sync group")
        rank = init_info.rank + get_world_group().rank_in_group
        # `timeout` bounds the wait for the sender to appear too (weightsync's own default for
        # that is 900 s).
        options = {"timeout": init_info.timeout, "connect_timeout": init_info.timeout}
        options["secret"] = init_info.secret
        if init_info.transport == "broadcast":  # the ipc receiver maps buffers where they live
            options["device"] = self.device
        # Join in a thread, so that this worker keeps stepping while it waits for the sender.
        # The engine calls `joined` until the join has completed, and `shutdown` gives it up.
        self.joining = Joining(
            lambda: create_receiver(
                init_info.transport,
                init_info.host,
                init_info.port,
                rank,
                init_info.num_receivers,
                **options,
            )
        )
        self.group = (
            f"the {init_info.transport} weight-sync group at {init_info.host}:{init_info.port} "
            f"as receiver {rank} of {init_info.num_receivers}"
        )

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise RuntimeError("no weight-sync group: call init_weight_sync first")
        self.touched = False

    def receive_weights(self, update_info: FerruleUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # Wait for the sender's announcement before touching the model: a sender that never
        # comes (a timeout) leaves the weights as they were, and the engine keeps serving.
        update = self.receiver.receive(timeout=update_info.timeout)
        self.touched = True
        initialize_layerwise_reload(self.model)
        # Layerwise reload keeps the tensors it is given until their whole layer has arrived
        # (q, k and v fill one fused parameter). But weightsync refills a bucket's buffer once
        # the loop moves past that bucket. So hand the reload copies, which are freed as soon as
        # each layer is processed.
        self.model.load_weights((name, tensor.clone()) for name, tensor in update)
        self.version = update.version

    def update_weights(self, update_info: dict) -> None:
        # The base class's version ends with torch.accelerator.synchronize(), which fails
        # without an accelerator. On a GPU the receiver already synchronised the copies it
        # handed out.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.touched:
            finalize_layerwise_reload(self.model, self.model_config)
            _refresh_tied_lm_heads(self.model)

    def shutdown(self) -> None:
        if self.joining is not None:
            self.joining.abandon()
            self.joining = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def _refresh_tied_lm_heads(model: torch.nn.Module) -> None:
    """Re-run weight processing for an LM head that shares its weight with the embeddings.

    vLLM 0.32 bug on CPU: the CPU backend gives the LM head its own packed copy of the weight
    (oneDNN / sgl GEMM) at start-up. Layerwise reload updates the shared embedding in place but,
    since no checkpoint tensor names the tied head, never reprocesses it, so the head keeps
    computing logits from the old weights. Processing it again repacks from the new weight (on
    GPU this processing is a no-op).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = list(model.modules())
    embeddings = {
        m.weight.data_ptr()
        for m in modules
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    for module in modules:
        if isinstance(module, ParallelLMHead) and module.weight.data_ptr() in embeddings:
            module.quant_method.process_weights_after_loading(module)


def joined(worker) -> bool:
    """Run in every worker by `collective_rpc`. Return whether the worker's join has completed,
    and raise the join's error if it failed."""
    engine = worker.weight_transfer_engine
    if engine.joining is None:
        if engine.receiver is None:
            raise RuntimeError("no weight-sync group joined or being joined")
        return True
    if not engine.joining.done():
        return False
    joining, engine.joining = engine.joining, None
    engine.receiver = joining.result()
    logger.info("joined %s", engine.group)
    return True


def received_version(worker) -> int:
    """Run in every worker by `collective_rpc`. Return the version of the last update that the
    worker loaded."""
    return worker.weight_transfer_engine.version


def weights_touched(worker) -> bool:
    """Run in every worker by `collective_rpc`. Return whether the failed update changed any of
    the worker's weights."""
    return worker.weight_transfer_engine.touched


def register() -> None:
    """The `vllm.general_plugins` entry point: make backend "ferrule" known in this process."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, FerruleWeightTransferEngine)
