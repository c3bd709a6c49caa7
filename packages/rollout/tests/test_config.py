"""The engine's config table: each backend gets the options it takes, bad combinations fail."""

import pytest
from pydantic import ValidationError

from ferrule_rollout.config import EngineConfig


def test_each_backend_gets_its_class_and_options():
    from ferrule_rollout.hf_engine import TransformersEngine
    from ferrule_rollout.vllm_engine import VLLMEngine

    vllm = EngineConfig(sleep_between_phases=True, enable_prefix_caching=True)
    assert vllm.engine_class() is VLLMEngine
    assert vllm.engine_options() == dict(
        max_model_len=128,
        gpu_memory_utilization=0.3,
        tensor_parallel_size=1,
        enforce_eager=None,  # the engine decides: CUDA graphs on GPUs, eager elsewhere
        enable_prefix_caching=True,
        enable_sleep_mode=True,  # vLLM must be started able to sleep
    )
    hf = EngineConfig(
        backend="transformers",
        max_batch_size=32,
        kv_cache_tokens=1000,
        compact_rows=False,
        reuse_cut_kv=True,
    )
    assert hf.engine_class() is TransformersEngine
    assert hf.engine_options() == dict(
        max_model_len=128,
        max_batch_size=32,
        kv_cache_tokens=1000,
        exact=False,
        compile_decode=True,  # "auto"
        compact_rows=False,
        reuse_cut_kv=True,
    )


def test_sampling_settings_of_the_table():
    table = EngineConfig(temperature=0.6, top_p=0.9, max_tokens=5)
    sampled = table.sampling(n=8)
    assert (sampled.n, sampled.temperature, sampled.top_p, sampled.max_tokens) == (8, 0.6, 0.9, 5)
    greedy = table.sampling(n=1, temperature=0.0)
    assert greedy.temperature == 0.0 and greedy.top_p == 1.0  # no truncation when greedy


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "transformers", "tensor_parallel_size": 2}, 'needs backend = "vllm"'),
        ({"backend": "sglang"}, "Input should be 'vllm' or 'transformers'"),
        ({"temprature": 1.0}, "Extra inputs are not permitted"),
        ({"temperature": 0}, "greater than 0"),
        ({"kv_cache_tokens": 4096}, 'kv_cache_tokens needs backend = "transformers"'),
        (
            {"backend": "transformers", "max_model_len": 4160, "kv_cache_tokens": 4096},
            "kv_cache_tokens 4096 cannot hold one sequence of max_model_len 4160",
        ),
        ({"backend": "transformers", "kv_cache_tokens": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_tables_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        EngineConfig(**fields)


def test_compile_decode_auto_is_off_where_compiling_is_not_measured_or_not_allowed():
    on = dict(backend="transformers")
    assert EngineConfig(**on).compiles_decode()
    assert not EngineConfig(**on, exact=True).compiles_decode()  # inductor reorders math
    assert not EngineConfig(**on, sleep_between_phases=True).compiles_decode()
    assert EngineConfig(**on, sleep_between_phases=True, compile_decode=True).compiles_decode()
    assert not EngineConfig(**on, compile_decode=False).compiles_decode()
    assert EngineConfig(backend="vllm").compile_decode == "auto"  # no refusal: it means "off"
    assert EngineConfig(backend="vllm", compile_decode="auto").compile_decode == "auto"  # as read
    with pytest.raises(ValueError, match='compile_decode needs backend = "transformers"'):
        EngineConfig(backend="vllm", compile_decode=True)
    with pytest.raises(ValueError, match="compile_decode"):
        EngineConfig(**on, compile_decode="sometimes")
