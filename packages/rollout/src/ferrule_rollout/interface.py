"""The one interface of ferrule-rollout's engines.

    def rollout(engine: Engine, prompts):      # vllm_engine.VLLMEngine (vLLM) or
        return engine.generate(prompts)        # hf_engine.TransformersEngine (transformers)

The launcher, the gRPC server and the episode runner use an engine only through the methods of
`Engine`, so either engine serves them. The code that the two engines share is in engine_base.py's
`EngineBase`.
"""

import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from ferrule_rollout.samples import Prompt, Sample, SamplingSettings


class Stream(Protocol):
    """The result of `generate_stream`: it yields samples as they finish, and `cancel()` drops
    the rest."""

    def __iter__(self) -> Iterator[Sample]: ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    model: str
    max_model_len: int  # prompt plus generated tokens

    @property
    def version(self) -> int: ...

    @property
    def paused(self) -> bool: ...

    def generate(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> list[Sample]: ...

    def generate_stream(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> Stream: ...

    def run_episodes(self, environment, prompts, settings=None, **options) -> list: ...

    def pause(self, mode: str = "wait", timeout: float | None = None) -> None: ...

    def resume(self) -> None: ...

    def init_weight_sync(
        self,
        transport: str,
        host: str,
        port: int,
        rank: int,
        num_receivers: int,
        timeout: float = 300.0,
        secret: str | None = None,
        cancel: threading.Event | None = None,
    ) -> None: ...

    def update_weights(self, mode: str = "wait", timeout: float | None = None) -> int: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self) -> None: ...

    def health(self) -> dict: ...

    def startup_seconds(self) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class WeightSyncGroup:
    """The trainer's weight-sync group that an engine joins: its address, the engine's receiver
    rank, how long to wait for the sender, and the group's secret."""

    transport: str
    host: str
    port: int
    rank: int
    num_receivers: int
    timeout: float
    secret: str | None

    def options(self) -> dict:
        return asdict(self)
