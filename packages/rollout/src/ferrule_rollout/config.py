"""The rollout engine's settings as a config table, for programs that read them from TOML.

    table = EngineConfig(backend="transformers", temperature=0.7)   # or a subclass's [rollout]
    engine = table.engine_class()(model, dtype="float32", **table.engine_options())
    samples = engine.generate(prompts, table.sampling(n=8))

EngineConfig is a ferrule_config `Table`: a pydantic model with a docstring under each field, in
which unknown keys are errors. `ferrule_config.load_config` reads a whole file and reports every
error at once.
"""

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from ferrule_config import Table
from ferrule_rollout.samples import SamplingSettings


class EngineConfig(Table):
    """The rollout engine's keys. ferrule-launcher's [rollout] table adds the engines' roles."""

    backend: Literal["vllm", "transformers"] = "vllm"
    """"vllm" (the default, and the faster engine) or "transformers" (a plain Hugging Face model,
    for machines without vLLM). The transformers engine has no tensor parallelism, and its rows
    join and leave only within a call."""

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0; the trainer scores tokens under the same temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_tokens: int = Field(8, ge=1)
    """Most new tokens per sample."""
    max_model_len: int = Field(128, ge=8)
    """Longest prompt + response the engine accepts."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Fraction of device memory for vLLM (of CPU memory on CPU, where VLLM_CPU_KVCACHE_SPACE
    takes precedence)."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """vLLM: the number of devices each engine shards its model over. Each of the engine's
    workers is a weight-sync receiver."""
    enforce_eager: bool | None = None
    """vLLM: no CUDA graphs (None: CUDA graphs on GPUs, eager elsewhere)."""
    enable_prefix_caching: bool = False
    """vLLM: reuse the KV cache of shared prompt prefixes (cleared on every weight update)."""
    sleep_between_phases: bool = False
    """Hybrid engine: free the engine's accelerator memory while the trainer trains on the same
    GPUs, and take the memory back to generate. The engine keeps its weights in host memory
    meanwhile (vLLM sleep level 1)."""
    max_batch_size: int = Field(256, ge=1)
    """transformers: the most sequences that decode at once. A call with more queues the rest,
    and they take the rows of finished sequences (vLLM schedules its own batches)."""
    kv_cache_tokens: int = Field(0, ge=0)
    """transformers: the KV cache's size in tokens. The rows share it in pages of 64 slots: a
    row takes pages as it grows and gives them back when it ends. 0 means max_batch_size x
    max_model_len, so no row ever waits. A smaller cache runs more rows in the same memory than
    max_model_len slots per row would, because at long caps most samples of a long-tailed batch
    are short (at 1.5B and a 16,384 cap, 512 rows ran in the memory of 128:
    benchmarks/RESULTS.md, issue 57). When the pages run out, the rows started last go back to
    the queue and run again from their prompts. They give the same samples, because the draws
    are keyed. Must be at least max_model_len."""
    compact_rows: bool = True
    """transformers: once no prompt of a call waits and the running rows fit in 1/16 of the
    rows, move them into those rows and decode at that narrower shape. A step costs its rows'
    weight reads whether the rows run or idle, and a long-tailed batch spends most steps on a
    few long responses (benchmarks/RESULTS.md, issue 57). Not in exact mode."""
    exact: bool = False
    """transformers: batch-invariant numerics in the engine and in the trainer's policy and
    reference (ferrule_rollout.exact). The logprobs that the engine samples with are then bit
    for bit the trainer's, and no rollout correction is needed. Generation is ~30% slower
    (measured at 1.5B on an H100, benchmarks/RESULTS.md). Needs top_p = 1 and no LoRA."""
    compile_decode: bool | Literal["auto"] = "auto"
    """transformers on CUDA: run decode steps and their log-softmax through torch.compile
    before they are captured as CUDA graphs (at 1.5B, a 512-row step went from 8.2 to 5.6 ms on
    an H100). Every call then decodes at one shape, max_batch_size rows x max_model_len slots,
    which compiles at the first call. It compiles region by region, so one compile serves every
    layer (~7 s at 1.5B on an H200, against ~38 s for the whole forward before 2026-11-30).
    "auto": on, unless exact is set (inductor reorders math) or sleep_between_phases is set
    (each wake makes new graphs, which was not measured with compiling)."""

    reuse_cut_kv: bool = False
    """transformers, with [loop] partial_rollout: a cut sample's keys and values stay in its
    row of the engine's KV cache, and the next step's call resumes the sample there instead of
    prefilling its prompt and tokens again. Those keys and values were computed under the
    weights from before the step's update, as in PipelineRL's in-flight updates (AReaL
    recomputes them, as this engine does without this key). The logprobs that the engine
    records are the ones each token was drawn with, which is what rollout correction uses. A
    call in between that does not continue the samples (an evaluation), or a sleep, loses the
    kept keys and values, and the samples are then prefilled. With several engines, a sample is
    resumed only when the launcher's split of the call sends it back to the engine that cut it
    (samples are not routed there; measured on one engine)."""

    @field_validator("tensor_parallel_size")
    @classmethod
    def _backend_supports(cls, size: int, info: ValidationInfo) -> int:
        if size > 1 and info.data.get("backend") == "transformers":
            raise ValueError(
                'tensor_parallel_size > 1 needs backend = "vllm"; the transformers engine runs '
                "on one device"
            )
        return size

    @field_validator("kv_cache_tokens")
    @classmethod
    def _holds_one_sequence(cls, tokens: int, info: ValidationInfo) -> int:
        if tokens and info.data.get("backend") != "transformers":
            raise ValueError(
                'kv_cache_tokens needs backend = "transformers" (vLLM sizes its '
                "cache from gpu_memory_utilization)"
            )
        longest = info.data.get("max_model_len", 0)
        if tokens and tokens < longest:
            raise ValueError(
                f"kv_cache_tokens {tokens} cannot hold one sequence of max_model_len {longest}"
            )
        return tokens

    @field_validator("exact", "compile_decode", "reuse_cut_kv")
    @classmethod
    def _transformers_only(cls, on: bool | str, info: ValidationInfo) -> bool | str:
        if on == "auto":  # resolved by compiles_decode(); means "off" for vLLM
            return on
        if on and info.data.get("backend") != "transformers":
            raise ValueError(f'{info.field_name} needs backend = "transformers"')
        if on and info.field_name == "exact" and info.data.get("top_p", 1.0) < 1:
            raise ValueError(
                "exact samples from the policy's own softmax, which the trainer scores: it "
                f"needs top_p = 1, got {info.data['top_p']}"
            )
        if on and info.field_name == "compile_decode" and info.data.get("exact"):
            raise ValueError("exact and compile_decode exclude each other (inductor reorders math)")
        if on and info.field_name == "reuse_cut_kv" and info.data.get("exact"):
            raise ValueError("exact recomputes every sequence's keys and values: no reuse_cut_kv")
        return on

    def engine_class(self):
        """The engine class of `backend` (imported here: vLLM loads only when it is chosen)."""
        if self.backend == "transformers":
            from ferrule_rollout.hf_engine import TransformersEngine

            return TransformersEngine
        from ferrule_rollout.vllm_engine import VLLMEngine

        return VLLMEngine

    def compiles_decode(self) -> bool:
        """compile_decode with "auto" resolved."""
        if self.compile_decode == "auto":
            return not self.exact and not self.sleep_between_phases
        return self.compile_decode

    def engine_options(self) -> dict:
        """The keyword arguments of `engine_class()` that this table sets."""
        if self.backend == "transformers":
            return dict(
                max_model_len=self.max_model_len,
                max_batch_size=self.max_batch_size,
                kv_cache_tokens=self.kv_cache_tokens or None,
                exact=self.exact,
                compile_decode=self.compiles_decode(),
                compact_rows=self.compact_rows,
                reuse_cut_kv=self.reuse_cut_kv,
            )
        return dict(
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_sleep_mode=self.sleep_between_phases,
        )

    def sampling(self, n: int, temperature: float | None = None) -> SamplingSettings:
        """Sampling settings of this table, `n` samples per prompt; temperature 0 is greedy."""
        temperature = self.temperature if temperature is None else temperature
        return SamplingSettings(
            n=n,
            temperature=temperature,
            top_p=self.top_p if temperature else 1.0,
            max_tokens=self.max_tokens,
        )
