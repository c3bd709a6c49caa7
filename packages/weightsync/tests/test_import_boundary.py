"""ferrule-weightsync is lifted into other projects' trainers: torch and the standard library only."""

SIBLINGS = ["ferrule_rewards", "ferrule_rollout", "ferrule_trainer", "ferrule_launcher"]


def test_uses_torch_only(import_boundary):
    # torch is its only declared dependency, and every import must be declared
    import_boundary(
        "ferrule_weightsync",
        never=["vllm", "deepspeed", "ray", "grpc", "transformers", *SIBLINGS],
    )
