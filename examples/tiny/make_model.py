"""Rebuild examples/tiny/model, the tiny example's starting model: `uv run python examples/tiny/make_model.py`.

The model is ferrule-testkit's tiny Qwen2 (2 layers, hidden 128, vocabulary 512, random weights,
seed 0) with its byte-level BPE tokenizer. It is shipped in the repository (about 1.5 MB) because
ferrule-testkit is a development tool, not a dependency of the launcher; the run's SFT warm
start ([sft] in examples/tiny.toml) teaches it the task's answer format first.
"""

import shutil
from pathlib import Path

from ferrule_testkit import tiny_model

TARGET = Path(__file__).parent / "model"

if __name__ == "__main__":
    source = tiny_model("qwen2", seed=0)
    shutil.rmtree(TARGET, ignore_errors=True)
    shutil.copytree(source, TARGET, ignore=shutil.ignore_patterns("DONE", "key.json"))
    print(f"wrote {TARGET} from {source}")
