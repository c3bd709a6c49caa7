"""ferrule-testkit: deterministic tiny tokenizers and language models for tests and benchmarks.

The kit also serves the examples. It is for development only and is not a dependency of any
published package. Importing it is cheap: torch, tokenizers and transformers are loaded only
when a model is first built.
"""

from ferrule_testkit.corpus import synthetic_corpus
from ferrule_testkit.models import (
    QWEN25_1_5B,
    QWEN25_7B,
    QWEN25_14B,
    QWEN25_32B,
    QWEN25_LARGE_VOCAB,
    QWEN25_SHAPES,
    QWEN25_VOCAB,
    SPECS,
    cache_root,
    shape_config,
    tiny_model,
    tiny_tokenizer,
)
from ferrule_testkit.preferences import policy_reversal_pairs, reversal_pairs, reversal_sft_rows
from ferrule_testkit.scoring import teacher_forced_logprobs

__all__ = [
    "QWEN25_1_5B",
    "QWEN25_7B",
    "QWEN25_14B",
    "QWEN25_32B",
    "QWEN25_LARGE_VOCAB",
    "QWEN25_SHAPES",
    "QWEN25_VOCAB",
    "SPECS",
    "cache_root",
    "policy_reversal_pairs",
    "reversal_pairs",
    "reversal_sft_rows",
    "shape_config",
    "synthetic_corpus",
    "teacher_forced_logprobs",
    "tiny_model",
    "tiny_tokenizer",
]
