"""ferrule-rollout: a vLLM rollout engine and gRPC server with in-place weight updates.

    from ferrule_rollout import VLLMEngine, SamplingSettings
    engine = VLLMEngine("path/to/model", dtype="float32")
    samples = engine.generate(["2 + 2 ="], SamplingSettings(n=4, max_tokens=32))

`TransformersEngine` (hf_engine.py) has the same interface without vLLM. Importing this package
is cheap: vLLM, torch and transformers are imported only when an engine starts.
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
    # Import the engine modules lazily. vllm_engine.py imports vLLM only when an engine starts,
    # but keeping the module itself out of the package import keeps the import light too.
    if name == "VLLMEngine":
        from ferrule_rollout.vllm_engine import VLLMEngine

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
