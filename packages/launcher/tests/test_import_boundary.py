"""The launcher composes everything, but `import ferrule_launcher` (and so `--help`) stays light."""


def test_import_boundary(import_boundary):
    import_boundary("ferrule_launcher", not_on_import=["vllm", "deepspeed", "torch", "ray"])
