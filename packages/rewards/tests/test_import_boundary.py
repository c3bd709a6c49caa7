"""ferrule-rewards deploys alone: no vLLM, DeepSpeed or Ray, and no torch unless a model is served."""

SIBLINGS = ["ferrule_weightsync", "ferrule_rollout", "ferrule_trainer", "ferrule_launcher"]


def test_import_boundary(import_boundary):
    import_boundary(
        "ferrule_rewards",
        never=["vllm", "deepspeed", "ray", *SIBLINGS],
        not_on_import=["torch", "transformers"],
    )
