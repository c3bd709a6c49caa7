"""How much GPU memory a model takes to train and to score, estimated from its config alone.

    shape = ModelShape.read("models/Qwen2.5-1.5B")     # config.json and safetensors headers
    peak = policy_train_peak(shape, dtype="bfloat16", zero_stage=2, ranks=1,
                             checkpointing=True, tokens=8192, response_share=0.75)
    peak / 2**30                                        # ~38 GiB: what the allocator reserves

The figures are what torch's caching allocator reserves at the phase's peak. The CUDA context
(~0.5 GiB per process) comes on top; launcher/plan.py adds it. The figures follow from where the
bytes go, with coefficients fitted to peaks measured at 1.5B on an H100 (benchmarks/
memory_gpu.py, benchmarks/RESULTS.md), and packages/trainer/tests/test_memory_gpu.py checks them
against new measurements:
- training state per parameter: bf16 weights (2 bytes), DeepSpeed's fp32 master weights and Adam
  moments (12) and fp32 gradients (4). Each is divided over the ranks by the ZeRO stage that
  shards it. With bf16, the bf16 gradients come on top (2 bytes; under ZeRO-1 and 2, 4 bytes
  were measured on every rank, with DeepSpeed's contiguous gradient buffer).
- activations per token of a micro-batch: each decoder layer keeps ~30 hidden widths and ~6.7
  MLP widths of bytes for backward. With gradient checkpointing, each layer keeps only its
  2-byte input, plus one layer's activations while that layer recomputes.
- the LM head: `sequences.response_logprobs` runs the head on HEAD_CHUNK response tokens at a
  time. The head's logits, their float32 copy and the cross-entropy's log-softmax therefore take
  a fixed HEAD_CHUNK x vocabulary x ~16 bytes while training (recomputed in backward) and ~6
  without gradients, plus the head's inputs per response token. A pass without gradients holds
  one layer's MLP widths per token at a time. Under ZeRO-3 the logits are held whole: ~12 bytes
  x vocabulary per response token in training and ~9.4 without gradients. With a 150k
  vocabulary, that is more than the whole body takes under checkpointing.
The module is pure Python (json and struct only), because the launcher plans before any process
or torch starts.
"""

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path

GiB = 2**30

# fitted at 1.5B (benchmarks/memory_gpu.py): bytes per token per layer, in hidden / MLP widths
BODY_HIDDEN, BODY_MLP = 30.0, 6.7
# response tokens per call of the LM head (sequences.response_logprobs): its float32 logits are
# HEAD_CHUNK x vocabulary x 4 bytes (0.6 GB at a 151,936-token vocabulary), however long the pass
HEAD_CHUNK = 1024
HEAD_CHUNK_TRAIN, HEAD_CHUNK_FORWARD = 16.0, 6.0  # bytes per chunk token per vocabulary entry
HEAD_TRAIN, HEAD_FORWARD = 12.0, 9.4  # whole logits (ZeRO-3): per response token, per entry
# reserved / allocated at the peak: 1.12-1.24 measured without checkpointing, 1.12-1.35 with
FRAGMENTATION, FRAGMENTATION_CHECKPOINTED = 1.18, 1.2
ZERO3_PREFETCH = 50_000_000  # parameters: engine.py's stage3_prefetch_bucket_size


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: parameter count and the widths activations are made of."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_width: int  # key / value heads x head dim: a token's keys (or values) in one layer
    heads: int = 1  # attention (query) heads

    @classmethod
    def read(cls, path: str | Path) -> "ModelShape":
        """Reads the shape from a Hugging Face folder's config.json. The parameter count comes
        from the safetensors headers (their first bytes) when the folder has any safetensors
        files; otherwise it is counted from the config."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config", config)  # multimodal configs nest the LM's config
        try:
            hidden, layers = config["hidden_size"], config["num_hidden_layers"]
            vocab = config["vocab_size"]
        except KeyError as missing:
            raise ValueError(f"{path / 'config.json'} has no {missing}: not a decoder LM") from None
        intermediate = config.get("intermediate_size", 4 * hidden)
        heads = config.get("num_attention_heads", 1)
        head_dim = config.get("head_dim") or hidden // heads
        kv_width = config.get("num_key_value_heads", heads) * head_dim
        shape = cls(0, layers, hidden, intermediate, vocab, kv_width, heads)
        tied = config.get("tie_word_embeddings", True)
        parameters = _counted(path) or shape.counted(heads * head_dim, tied)
        return replace(shape, parameters=parameters)

    def counted(self, query_width: int, tied: bool) -> int:
        """Parameters of a Llama / Qwen-style decoder of this shape (biases aside)."""
        attention = self.hidden * (query_width + self.kv_width) * 2  # q and o; k and v
        mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if tied else 2)
        return embeddings + self.layers * (attention + mlp + 2 * self.hidden) + self.hidden

    def weights(self, dtype: str) -> int:
        return self.parameters * bytes_per(dtype)


def bytes_per(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _counted(path: Path) -> int:
    """Parameters in the folder's safetensors files, from their JSON headers (0: none)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(size, 100 * 2**20)))
        except (struct.error, ValueError) as err:
            raise ValueError(f"{file}: not a safetensors file ({err})") from None
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


# -- the phases ----------------------------------------------------------------------------------


def training_state(
    shape: ModelShape,
    *,
    dtype: str,
    zero_stage: int,
    ranks: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    lora: bool = False,
) -> tuple[int, int]:
    """One rank's (resident, gradients) bytes of a trained model. The resident bytes are the
    weights and optimizer states, held throughout. The gradients fill as backward frees the
    activations, so the peak is the larger of resident + activations and resident + gradients.
    With LoRA, only the frozen weights count (the adapters and their states are small)."""
    p, weight = shape.parameters, bytes_per(dtype)
    if lora:
        return p * weight, 0
    # fp32 training keeps no master copy: the weights are the master weights
    optimizer = 0 if offload_optimizer else p * (12 if dtype == "bfloat16" else 8)
    if zero_stage == 0:  # DeepSpeed's bf16 optimizer: bf16 and fp32 gradients
        return p * weight + optimizer, p * (6 if dtype == "bfloat16" else 4)
    weights = 0 if offload_params else p * weight
    gradients = p * 4
    optimizer //= ranks
    if zero_stage >= 2:
        gradients //= ranks
    if zero_stage < 3 and dtype == "bfloat16":  # bf16 gradients and the contiguous buffer
        gradients += p * 4
    if zero_stage == 3:
        weights = weights // ranks + zero3_gathered(shape, dtype)
    return weights + optimizer, gradients


def frozen_weights(shape: ModelShape, dtype: str, zero_stage: int = 0, ranks: int = 1) -> int:
    """A frozen model's weights on one rank (the reference; sharded under ZeRO-3)."""
    weights = shape.weights(dtype)
    return weights // ranks + zero3_gathered(shape, dtype) if zero_stage == 3 else weights


def zero3_gathered(shape: ModelShape, dtype: str) -> int:
    """The whole parameters that ZeRO-3 holds while a pass uses them: the largest one (the
    embedding, which the LM head may share) twice over, once in use and once fetched ahead,
    plus the prefetch bucket."""
    return bytes_per(dtype) * (2 * shape.vocab * shape.hidden + ZERO3_PREFETCH)


def train_activations(
    shape: ModelShape,
    tokens: int,
    response_share: float,
    *,
    checkpointing: bool,
    whole_logits: bool = False,
) -> int:
    """The bytes that one micro-batch of `tokens` (padded) tokens keeps for backward. The
    `response_share` of the tokens goes through the LM head; with `whole_logits` (ZeRO-3) the
    head's logits are held whole."""
    layer = BODY_HIDDEN * shape.hidden + BODY_MLP * shape.intermediate
    body = (2 * shape.hidden * shape.layers + layer) if checkpointing else layer * shape.layers
    if whole_logits:
        return int(tokens * (body + HEAD_TRAIN * shape.vocab * response_share))
    head_inputs = 4 * shape.hidden * response_share  # the hidden states and the chunks' rows
    chunk = HEAD_CHUNK_TRAIN * shape.vocab * min(HEAD_CHUNK, tokens)
    return int(tokens * (body + head_inputs) + chunk)


def forward_activations(
    shape: ModelShape, tokens: int, response_share: float, *, whole_logits: bool = False
) -> int:
    """The bytes of a pass without gradients (old log-probs, the reference, values): one
    layer's output at a time, plus the LM head's logits for one chunk, or for every response
    token with `whole_logits`."""
    if whole_logits:
        return int(tokens * (8 * shape.hidden + HEAD_FORWARD * shape.vocab * response_share))
    chunk = HEAD_CHUNK_FORWARD * shape.vocab * min(HEAD_CHUNK, tokens)
    return int(tokens * (6 * shape.intermediate + 8 * shape.hidden) + chunk)


def policy_train_peak(
    shape: ModelShape,
    *,
    dtype: str,
    zero_stage: int,
    ranks: int,
    checkpointing: bool,
    tokens: int,
    response_share: float,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    lora: bool = False,
) -> int:
    """A trained model's reserved memory at its peak: its state plus a micro-batch's
    activations, or plus its gradients, whichever is larger."""
    resident, gradients = training_state(
        shape,
        dtype=dtype,
        zero_stage=zero_stage,
        ranks=ranks,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        lora=lora,
    )
    activations = train_activations(
        shape, tokens, response_share, checkpointing=checkpointing, whole_logits=zero_stage == 3
    )
    fragmentation = FRAGMENTATION_CHECKPOINTED if checkpointing else FRAGMENTATION
    return int(fragmentation * (resident + max(activations, gradients)))


def forward_peak(shape: ModelShape, dtype: str, tokens: int, response_share: float, **zero) -> int:
    """A frozen model's reserved memory while it scores a micro-batch of `tokens` tokens
    (`zero`: zero_stage, ranks, as `frozen_weights`)."""
    weights = frozen_weights(shape, dtype, **zero)
    whole = zero.get("zero_stage") == 3
    activations = forward_activations(shape, tokens, response_share, whole_logits=whole)
    return int(FRAGMENTATION * (weights + activations))
