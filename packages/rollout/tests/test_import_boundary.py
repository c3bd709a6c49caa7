"""ferrule-rollout may use weightsync and vLLM, never the trainer's stack or Ray."""


def test_import_boundary(import_boundary):
    import_boundary(
        "ferrule_rollout",
        never=["deepspeed", "ray", "ferrule_trainer", "ferrule_rewards", "ferrule_launcher"],
        not_on_import=["vllm", "torch"],
    )
