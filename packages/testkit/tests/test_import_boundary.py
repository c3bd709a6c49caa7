"""Importing the kit is cheap; torch and transformers load when a model is built."""


def test_import_boundary(import_boundary):
    import_boundary(
        "ferrule_testkit",
        never=[
            "vllm",
            "deepspeed",
            "ray",
            "ferrule_rollout",
            "ferrule_trainer",
            "ferrule_launcher",
        ],
        not_on_import=["torch", "transformers", "tokenizers"],
    )
