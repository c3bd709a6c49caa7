"""ferrule-grpc-auth is for any gRPC server: grpcio and the standard library only."""


def test_uses_grpcio_only(import_boundary):
    import_boundary(
        "ferrule_grpc_auth",
        never=[
            "torch", "vllm", "deepspeed", "ray", "transformers", "ferrule_weightsync",
            "ferrule_rewards", "ferrule_rollout", "ferrule_trainer", "ferrule_launcher",
        ],
    )  # fmt: skip
