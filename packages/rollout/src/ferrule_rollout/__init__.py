"""ferrule-rollout: a vLLM rollout engine and gRPC server with in-place weight updates.

    from ferrule_rollout import VLLMEngine, SamplingSettings
    engine = VLLMEngine("path/to/model", dtype="float32")
    samples = engine.generate(["2 + 2 ="], SamplingSettings(n=4, max_tokens=32))

`TransformersEngine` (hf_engine.py) has the same interface without vLLM. Importing this package
is cheap: vLLM, torch and transformers load when an engine starts.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from ferrule_rollout.samples import (
    BadRequestError,
    Continuation,
    Prompt,
    RolloutError,
    Sample,
    SamplingSettings,
    VersionSpan,
)

try:
    __version__ = _version("ferrule-rollout")
except PackageNotFoundError:  # run from a source checkout on PYTHONPATH (the GPU machines)
    __version__ = "0+source"


def __getattr__(name: str):
    if name == "VLLMEngine":  # lazily: it imports vLLM only when an engine starts, but
        from ferrule_rollout.vllm_engine import VLLMEngine  # keep the module itself light too

        return VLLMEngine
    if name == "TransformersEngine":
        from ferrule_rollout.hf_engine import TransformersEngine

        return TransformersEngine
    raise AttributeError(f"module 'ferrule_rollout' has no attribute {name!r}")


__all__ = [
    "BadRequestError",
    "Continuation",
    "Prompt",
    "RolloutError",
    "Sample",
    "SamplingSettings",
    "TransformersEngine",
    "VLLMEngine",
    "VersionSpan",
]
