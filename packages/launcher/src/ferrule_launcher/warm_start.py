"""The SFT warm start before RL ([sft] steps > 0): ferrule-trainer trains on the task's answers.

    model_path = warm_start(config, out)     # [model] path itself when [sft] steps = 0

The examples come from [sft] data, a JSONL file as `rlhf-train sft` reads it, or else from the
synthetic task (never its RL or held-out prompts). The training is ferrule-trainer's SFT, run in
a Ray task of its own, and it is resumable: a run killed during the warm start continues it on
--resume, and a finished warm start (out/sft/model) is not redone.
"""

import time
from pathlib import Path

from ferrule_launcher.calls import get
from ferrule_launcher.config import Config
from ferrule_launcher.task import write_sft_data


def warm_start(config: Config, out: Path) -> str:
    """The model the RL stage starts from: [model] path, or the model the SFT warm start made."""
    if not config.sft.steps:
        return str(config.model.path)
    target = out / "sft" / "model"
    if (target / "config.json").exists():
        return str(target)
    import ray

    data = config.sft.data
    if data is None:
        data = out / "sft" / "data.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        write_sft_data(data, config.task, config.sft.steps, config.sft.batch_size)
    print(f"sft: {config.sft.steps} steps of warm start on {data}", flush=True)
    start = time.monotonic()
    task = ray.remote(num_cpus=0.5, max_calls=1)(run_sft)
    get(task.remote(config, str(data), str(out / "sft")), "sft warm start")
    print(f"sft: done in {time.monotonic() - start:.0f} s -> {target}", flush=True)
    return str(target)


def run_sft(config: Config, data_path: str, out_dir: str) -> None:
    """Run ferrule-trainer's SFT on `data_path` with the [sft] table's settings (in a Ray task)."""
    from ferrule_trainer import sft

    steps = config.sft.steps
    sft.train(
        sft.SFTConfig(
            model=sft.SFTModelConfig(
                path=config.model.path, dtype=config.model.dtype, zero_stage=0
            ),
            data=sft.SFTDataConfig(
                path=data_path,
                prompt_key=config.sft.prompt_key,
                response_key=config.sft.response_key,
                max_length=config.rollout.max_model_len,
            ),
            train=sft.SFTTrainConfig(
                batch_size=config.sft.batch_size,
                micro_batch_size=config.sft.batch_size,
                learning_rate=config.sft.learning_rate,
                max_steps=steps,
                seed=config.loop.seed,
            ),
            output=sft.SFTOutputConfig(dir=out_dir, save_every=max(steps // 2, 1), resume=True),
        ),
        log=lambda line: None,
    )
