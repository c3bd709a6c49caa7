"""ferrule-testkit: deterministic tiny tokenizers and language models for tests, benchmarks and examples.

Development only; not a dependency of any published package. Importing it is cheap: torch,
tokenizers and transformers load when a model is first built.
"""

from ferrule_testkit.corpus import synthetic_corpus
from ferrule_testkit.models import (
    QWEN25_1_5B,
    QWEN25_VOCAB,
    SPECS,
    cache_root,
    tiny_model,
    tiny_tokenizer,
)
from ferrule_testkit.preferences import policy_reversal_pairs, reversal_pairs, reversal_sft_rows
from ferrule_testkit.scoring import teacher_forced_logprobs

__all__ = [
    "QWEN25_1_5B",
    "QWEN25_VOCAB",
    "SPECS",
    "cache_root",
    "policy_reversal_pairs",
    "reversal_pairs",
    "reversal_sft_rows",
    "synthetic_corpus",
    "teacher_forced_logprobs",
    "tiny_model",
    "tiny_tokenizer",
]
