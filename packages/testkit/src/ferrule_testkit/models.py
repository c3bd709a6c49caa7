"""Tiny causal language models and their tokenizer, built locally and cached on disk.

    from ferrule_testkit import tiny_model
    path = tiny_model("qwen2")          # a directory for AutoModelForCausalLM / vllm.LLM

No model hub is reachable from our machines, so every test, benchmark and example model is made
here: a byte-level BPE tokenizer trained on `corpus.synthetic_corpus`, and a randomly initialised
Qwen2- or Llama-style model, saved with `save_pretrained`. The same seed gives the same bytes.
Builds take a few seconds and are cached under $FERRULE_CACHE (default ~/.cache/ferrule), keyed
by every input that changes the result, so tests in several processes share one build.
"""

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ferrule_testkit.corpus import synthetic_corpus

# Shapes are tiny but valid for vLLM's CPU backend: head size 64 (it rejects 16).
SPECS = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
}
# A real size for GPU tests and benchmarks: tiny_model("qwen2", vocab_size=QWEN25_VOCAB,
# **QWEN25_1_5B) has the shape of Qwen2.5-1.5B, with random weights and the kit's tokenizer.
QWEN25_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN25_VOCAB = 151_936
# The larger Qwen2.5 shapes, with the widths from their config.json, untied heads and a
# 152,064-token vocabulary:
# tiny_model("qwen2", vocab_size=QWEN25_LARGE_VOCAB, dtype="bfloat16", **QWEN25_7B).
# 14B and 32B only size the memory plan, from their config alone (`shape_config`).
QWEN25_LARGE_VOCAB = 152_064
_QWEN25_LARGE = dict(
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
QWEN25_7B = dict(
    _QWEN25_LARGE,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
)
QWEN25_14B = dict(
    _QWEN25_LARGE,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
)
QWEN25_32B = dict(QWEN25_14B, intermediate_size=27648, num_hidden_layers=64)  # 14B's widths
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
_KIT_VERSION = 1  # bump when the build recipe changes, so stale caches are not reused


def cache_root() -> Path:
    return Path(os.environ.get("FERRULE_CACHE", Path.home() / ".cache" / "ferrule"))


def _cached(kind: str, key: dict, build) -> Path:
    """Return the cached directory for `key`, building it once under a file lock."""
    import tokenizers
    import torch
    import transformers

    key = dict(
        key,
        kit=_KIT_VERSION,
        torch=torch.__version__,
        transformers=transformers.__version__,
        tokenizers=tokenizers.__version__,
    )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    target = cache_root() / "testkit" / f"{kind}-{digest}"
    if (target / "DONE").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "DONE").exists():
            work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
            build(work)
            (work / "key.json").write_text(json.dumps(key, indent=2, sort_keys=True))
            (work / "DONE").write_text("")
            shutil.rmtree(target, ignore_errors=True)
            work.rename(target)
    return target


def tiny_tokenizer(seed: int = 0, vocab_size: int = 512) -> Path:
    """A directory holding a byte-level BPE `PreTrainedTokenizerFast` trained on synthetic text."""

    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|endoftext|>",
            pad_token="<|pad|>",
            model_max_length=SPECS["qwen2"]["max_position_embeddings"],
        )
        fast.save_pretrained(out)

    return _cached("tokenizer", {"seed": seed, "vocab_size": vocab_size}, build)


def tiny_model(
    arch: str = "qwen2",
    seed: int = 0,
    vocab_size: int | None = None,
    dtype: str = "float32",
    **overrides,
) -> Path:
    """A directory with a randomly initialised tiny `arch` model, its config and tokenizer.

    `overrides` change config fields (for example `num_hidden_layers=4`); they are part of the
    cache key. `vocab_size` pads the embedding and head to a real vocabulary (151,936 for
    Qwen2.5) while the tokenizer stays small, so that benchmarks pay for a real LM head. Token
    ids beyond the tokenizer's vocabulary never appear in a prompt, but the model can sample
    them. `dtype` "bfloat16" saves half the bytes (a 7B model takes 15 GB instead of 30) and
    initialises on the GPU when there is one (a 7B model's random init takes minutes on a
    CPU).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if arch not in SPECS:
        raise ValueError(f"unknown tiny model architecture {arch!r}; choose one of {sorted(SPECS)}")
    spec = dict(SPECS[arch], **overrides)
    tokenizer_dir = tiny_tokenizer(seed)

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = AutoConfig.for_model(
            **spec,
            vocab_size=vocab_size or len(tokenizer),
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            torch_dtype=dtype,
        )
        torch.manual_seed(seed)
        on = "cuda" if dtype == "bfloat16" and torch.cuda.is_available() else "cpu"
        with torch.device(on):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, dtype))
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        del model
        if on == "cuda":  # the caller measures the GPU next, and a 7B build left 15 GB cached
            torch.cuda.empty_cache()

    if vocab_size is not None:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
        if vocab_size < size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the kit tokenizer's {size}")
    key = {"seed": seed, "spec": spec, "tokenizer": tokenizer_dir.name}
    if vocab_size is not None:  # only if set, so the default models keep their cached builds
        key["vocab_size"] = vocab_size
    if dtype != "float32":
        key["dtype"] = dtype
    return _cached(f"{arch}", key, build)


QWEN25_SHAPES = {"1.5b": QWEN25_1_5B, "7b": QWEN25_7B, "14b": QWEN25_14B, "32b": QWEN25_32B}


def shape_config(name: str) -> Path:
    """A folder holding only the config.json of a Qwen2.5 shape ("1.5b", "7b", "14b", "32b").
    The memory plan reads it: `rlhf-launch CONFIG --plan` sizes a run from it, counting the
    weights from the widths. The folder has no weights, so it cannot be trained or served."""
    if name not in QWEN25_SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {sorted(QWEN25_SHAPES)}")
    vocab = QWEN25_VOCAB if name == "1.5b" else QWEN25_LARGE_VOCAB
    config = dict(QWEN25_SHAPES[name], model_type="qwen2", vocab_size=vocab, torch_dtype="bfloat16")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    target = cache_root() / "testkit" / f"shape-{name}-{digest}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return target
