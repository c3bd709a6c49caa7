"""ferrule-trainer may use weightsync, torch, DeepSpeed and transformers, never vLLM or Ray."""


def test_import_boundary(import_boundary):
    import_boundary(
        "ferrule_trainer",
        never=["vllm", "ray", "ferrule_rollout", "ferrule_rewards", "ferrule_launcher"],
        not_on_import=["deepspeed", "torch"],
    )
