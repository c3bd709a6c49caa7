"""The rollout engine's settings as a config table, for programs that read them from TOML.

    class RolloutTable(EngineConfig): engines: int = 1      # ferrule-launcher's [rollout] adds keys
    engine = RolloutEngine(model, dtype="float32", **table.engine_options())
    settings = table.sampling(n=8)

A pydantic model with a docstring under each field; unknown keys are errors. The loader that
reads and reports errors for a whole file is the reader's (ferrule-launcher uses
ferrule-trainer's `load_config`).
"""

from pydantic import BaseModel, ConfigDict, Field

from ferrule_rollout.samples import SamplingSettings


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0; the trainer scores tokens under the same temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_tokens: int = Field(8, ge=1)
    """Most new tokens per sample."""
    max_model_len: int = Field(128, ge=8)
    """Longest prompt + response the engine accepts."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Fraction of device memory for vLLM (of CPU memory on CPU; VLLM_CPU_KVCACHE_SPACE wins)."""

    def engine_options(self) -> dict:
        """The keyword arguments of `RolloutEngine` that this table sets."""
        return dict(
            max_model_len=self.max_model_len, gpu_memory_utilization=self.gpu_memory_utilization
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
