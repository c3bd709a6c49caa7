"""`rlhf-rollout`: run a rollout engine as a standalone gRPC server.

    rlhf-rollout serve --model PATH [--bind 127.0.0.1:50052] [--dtype float32] [--tp 2] ...
    rlhf-rollout serve --model PATH --bind 0.0.0.0:50052 --token-file token --tls-cert ...

Prints one line `rlhf-rollout: serving MODEL on HOST:PORT` once the engine is up (tests and
launchers wait for it), and shuts down cleanly on SIGINT / SIGTERM. Exit status 2: bad
arguments, an address beyond loopback without client authentication (checked before the
model loads), or a model that cannot be loaded.
"""

import argparse
import logging
import os
import signal
import sys
import threading

from ferrule_grpc_auth import add_server_options, check_bind, server_security
from ferrule_rollout.security import TOKEN_ENV
from ferrule_rollout.server import CONTROL_THREADS  # imports grpc, but not vLLM or torch

DEFAULT_BIND = "127.0.0.1:50052"  # the reward server uses 50051, so both can run side by side


def _at_least(lowest: int):
    """An argparse type that accepts an int >= `lowest` and otherwise says what is wrong."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be >= {lowest}")
        return value

    return parse


_at_least_1 = _at_least(1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlhf-rollout", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start a vLLM engine behind a gRPC server")
    serve.add_argument("--model", required=True, help="a local Hugging Face model folder")
    serve.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        help="HOST:PORT (port 0: any free). Anything but loopback needs a token or mutual TLS",
    )
    add_server_options(serve, token_env=TOKEN_ENV)
    serve.add_argument(
        "--engine",
        choices=("vllm", "transformers"),
        default="vllm",
        help="vllm, or the transformers engine for machines without vLLM (default: vllm)",
    )
    serve.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    serve.add_argument("--max-model-len", type=int, help="default: the model's own")
    serve.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    serve.add_argument("--enable-prefix-caching", action="store_true")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--kv-cache-gib",
        type=float,
        default=1.0,
        help="CPU only: memory for the KV cache (VLLM_CPU_KVCACHE_SPACE), unless already set",
    )
    serve.add_argument(
        "--multiprocess",
        action="store_true",
        help="run vLLM's engine core in its own process (default: in this one)",
    )
    serve.add_argument("--enable-sleep-mode", action="store_true", help="GPU only")
    serve.add_argument(
        "--max-workers",
        type=_at_least(CONTROL_THREADS + 1),
        default=64,
        help=f"gRPC handler threads: {CONTROL_THREADS} are kept for health and control calls, the "
        "rest bound the generation calls at once (more are RESOURCE_EXHAUSTED; default: "
        "%(default)s)",
    )
    limit = serve.add_argument
    limit(
        "--max-request-sequences",
        type=_at_least_1,
        default=4096,
        help="most sequences (prompts x n) one call may ask for (default: %(default)s)",
    )
    limit(
        "--max-sequences-in-flight",
        type=_at_least_1,
        default=16384,
        help="most sequences of every call at once; more is RESOURCE_EXHAUSTED (default: "
        "%(default)s)",
    )
    limit(
        "--max-prompt-bytes",
        type=_at_least_1,
        default=1 << 20,
        help="largest prompt text, checked before it is tokenized (default: %(default)s)",
    )
    return parser.parse_args(argv)


def _engine(args: argparse.Namespace):
    if args.engine == "transformers":
        from ferrule_rollout.hf_engine import TransformersEngine

        return TransformersEngine(
            args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed
        )
    from ferrule_rollout.vllm_engine import VLLMEngine

    if args.kv_cache_gib is not None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_gib:g}")
    return VLLMEngine(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        in_process=not args.multiprocess,
        enable_sleep_mode=args.enable_sleep_mode,
    )


def serve(args: argparse.Namespace) -> int:
    from ferrule_rollout.samples import RolloutError
    from ferrule_rollout.server import serve as start_server

    try:  # check the address before the engine loads, so that refusing it costs nothing
        token, tls = server_security(args, token_env=TOKEN_ENV)
        client_auth = tls is not None and tls.client_ca is not None
        check_bind(args.bind, token=token, client_auth=client_auth, token_env=TOKEN_ENV)
        engine = _engine(args)
    except (ValueError, RolloutError) as err:
        print(f"rlhf-rollout: error: {err}", file=sys.stderr)
        return 2
    server, port = start_server(
        engine,
        args.bind,
        args.max_workers,
        token=token,
        tls=tls,
        max_request_sequences=args.max_request_sequences,
        max_sequences_in_flight=args.max_sequences_in_flight,
        max_prompt_bytes=args.max_prompt_bytes,
    )
    host = args.bind.rsplit(":", 1)[0]
    print(f"rlhf-rollout: serving {engine.model} on {host}:{port}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("rlhf-rollout: shutting down", flush=True)
    server.stop(grace=5).wait()
    engine.close()
    return 0


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(serve(args))


if __name__ == "__main__":
    main()
