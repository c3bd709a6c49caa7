"""ferrule-config is read by every package: pydantic and the standard library only."""


def test_uses_pydantic_only(import_boundary):
    import_boundary(
        "ferrule_config",
        never=[
            "torch", "vllm", "deepspeed", "ray", "transformers", "grpc", "ferrule_weightsync",
            "ferrule_grpc_auth", "ferrule_rewards", "ferrule_rollout", "ferrule_trainer",
            "ferrule_launcher",
        ],
    )  # fmt: skip
