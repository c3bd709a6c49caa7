"""ferrule-trainer may use weightsync, torch, DeepSpeed and transformers, never vLLM or Ray."""

import subprocess
import sys


def test_import_boundary(import_boundary):
    import_boundary(
        "ferrule_trainer",
        never=["vllm", "ray", "ferrule_rollout", "ferrule_rewards", "ferrule_launcher"],
        not_on_import=["deepspeed", "torch"],
    )


def test_rl_math_modules_import_torch_only():
    """The losses and estimators stay testable without DeepSpeed or transformers (DESIGN.md)."""
    modules = [
        "advantages",
        "aggregation",
        "batch",
        "importance",
        "kl",
        "losses",
        "reward_shaping",
        "rl",
    ]
    imports = "; ".join(f"import ferrule_trainer.{name}" for name in modules)
    code = f"import sys; {imports}; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    heavy = {"deepspeed", "transformers", "ferrule_weightsync"} & {
        name.split(".")[0] for name in loaded
    }
    assert not heavy, f"the RL math modules import {sorted(heavy)}"
