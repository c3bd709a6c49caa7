"""The `rlhf-rewards` command: serve rewards, or score JSON lines against a running server.

    rlhf-rewards serve --function ferrule_rewards.builtin:exact_match       # 127.0.0.1:50051
    rlhf-rewards serve --model ./my-reward-model --bind 0.0.0.0:50051 --token-file token
    rlhf-rewards serve --function my_rewards:score --workers 8   # 8 servers on one port
    echo '{"response": "#### 4", "label": "4"}' | rlhf-rewards score 127.0.0.1:50051
    rlhf-rewards health 127.0.0.1:50051       # exit status 0 when every address is SERVING

`serve` logs `serving ... on HOST:PORT` once it accepts calls, and drains on SIGTERM. With
`--address-file`, it also writes HOST:PORT to that file: this is how a program that started it
on port 0 learns the port. Errors in the arguments exit with status 2 and say what was wrong,
before anything starts.
"""

import argparse
import asyncio
import importlib.util
import json
import math
import sys
from functools import partial

from ferrule_grpc_auth import (
    add_client_options,
    add_server_options,
    client_security,
    server_security,
)
from ferrule_rewards import logs
from ferrule_rewards.client import RewardError, RewardServersUnavailable
from ferrule_rewards.security import TOKEN_ENV


def _number(kind, low, high=math.inf, *, low_included=True):
    """An argparse type for a finite `kind` in [low, high], or in (low, high] when not
    `low_included`. A value out of range gets a message that names the range."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        above = value >= low if low_included else value > low
        if not (above and value <= high and math.isfinite(value)):
            bound = f"{'>=' if low_included else '>'} {low:g}"
            if high != math.inf:
                bound += f" and <= {high:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {bound}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


_COUNT = _number(int, 1)
MODEL_EXTRA = ("torch", "transformers")  # what ferrule-rewards[model] adds
DEFAULT_BIND = "127.0.0.1:50051"  # rlhf-rollout serve uses 50052, so both run side by side
# All processes start at once: an unbounded count would start them until the machine gives out.
_PROCESSES = _number(int, 1, 256)
_SECONDS = _number(float, 0, low_included=False)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`rlhf-rewards serve`'s options, in --help's groups."""
    _what_to_serve(parser)
    _listening(parser.add_argument_group("listening"))
    add_server_options(parser, token_env=TOKEN_ENV)
    _limits(parser.add_argument_group("scoring processes and limits (per worker)"))
    _reward_model(parser.add_argument_group("a reward model (--model)"))


def _what_to_serve(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--function",
        metavar="MODULE:FUNCTION",
        help="Python reward function, `module:function` or `path/file.py:function`",
    )
    what.add_argument(
        "--model",
        metavar="PATH",
        help="local Hugging Face sequence-classification reward model folder "
        "(needs ferrule-rewards[model])",
    )


def _listening(group) -> None:
    add = group.add_argument
    add(
        "--bind",
        default=DEFAULT_BIND,
        help="host:port to listen on; port 0 picks a free one. Anything but loopback needs a "
        "token or TLS (default: %(default)s)",
    )
    add(
        "--grace",
        type=_number(float, 0),
        default=30.0,
        help="seconds calls in flight get to finish after SIGTERM (default: %(default)s)",
    )
    add(
        "--address-file",
        help="once the server accepts calls, write its host:port here (what a program that "
        "started it with port 0 reads)",
    )


def _limits(group) -> None:
    add = group.add_argument
    add(
        "--timeout",
        type=_SECONDS,
        default=30.0,
        help="seconds a reward function may spend on one sample (on one batch, for per-batch "
        "functions); past it, its scoring process is killed and replaced (default: %(default)s)",
    )
    add(
        "--call-timeout",
        type=_SECONDS,
        default=60.0,
        help="seconds one call may take, whatever its samples do (a shorter client deadline "
        "wins); samples without a reward by then get TIMEOUT (default: %(default)s)",
    )
    add(
        "--processes",
        type=_PROCESSES,
        default=1,
        help="scoring processes per server process (at most 256): calls scored at once. Write "
        "an I/O-bound "
        "function async (its samples run concurrently) rather than raising this "
        "(default: %(default)s)",
    )
    add(
        "--max-batch",
        type=_COUNT,
        default=4096,
        help="most samples per call (default: %(default)s)",
    )
    add(
        "--max-message-mb",
        type=_number(float, 0, 1024, low_included=False),
        default=64,
        help="largest request, in MiB, at most 1024 (default: %(default)s)",
    )
    add(
        "--max-log-mb",
        type=_number(float, 0, 1024),
        default=1,
        help="MiB of each scoring process's stdout and stderr (the function's prints) that "
        "reach the server's log, 0 to 1024; the rest is dropped until the process is replaced "
        "(default: %(default)s)",
    )
    add(
        "--max-sub-scores",
        type=_number(int, 0, 1_000_000),
        default=1024,
        help="sub-scores one sample may return, 0 to 1000000; more is that sample's "
        "INVALID_REWARD (default: %(default)s)",
    )
    add(
        "--workers",
        type=_PROCESSES,
        default=1,
        help="gRPC server processes sharing the port (SO_REUSEPORT; at most 256), each with its own "
        "--processes scoring processes; limits (--max-concurrency...) are per worker "
        "(default: %(default)s)",
    )
    add(
        "--max-concurrency",
        type=_COUNT,
        default=32,
        help="calls admitted at once (scored, or waiting for a scoring process), per worker; "
        "more are refused with RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    add(
        "--max-connections-per-peer",
        type=_number(int, 0, 4096),
        default=128,
        help="connections one peer (an IP address; an IPv6 /64) may hold open, per worker; "
        "more are reset on arrival. 0 to 4096; 0 leaves only the bound in all, 4096 "
        "(default: %(default)s)",
    )


def _reward_model(group) -> None:
    add = group.add_argument
    add("--device", default="auto", help="reward model device: auto, cpu, cuda, cuda:1...")
    add("--dtype", default="auto", help="reward model dtype: auto, float32, bfloat16, float16")
    add("--model-batch-size", type=_COUNT, default=32, help="samples per model forward pass")
    add(
        "--model-batch-tokens",
        type=_COUNT,
        default=32768,
        help="tokens per model forward pass: samples x the longest one's tokens (a longer "
        "sample goes alone; default: %(default)s)",
    )
    add("--max-length", type=_COUNT, help="longest prompt + response the model scores, in tokens")
    add(
        "--normalize",
        action="store_true",
        help="reward model: report (score - mean) / std, with the held-out mean and std saved "
        "beside it (reward_stats.json, written by `rlhf-train rm`)",
    )


def _client_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("addresses", nargs="+", metavar="ADDRESS", help="host:port of one or more replicas")
    add_client_options(parser, token_env=TOKEN_ENV)
    add("--timeout", type=_SECONDS, default=60.0, help="deadline per call in seconds")
    add(
        "--connect-timeout",
        type=_SECONDS,
        default=5.0,
        help="seconds to keep trying while no address can be reached or takes the call, then "
        "fail naming each address and what it said (default: %(default)s)",
    )


def make_scorer(args):
    """Build the scorer that the `rlhf-rewards serve` arguments `args` ask for. Each scoring
    process calls this."""
    if args.function:
        from ferrule_rewards.functions import FunctionScorer

        return FunctionScorer.load(args.function, timeout=args.timeout)
    _check_model_extra()
    from ferrule_rewards.model import ModelScorer

    return ModelScorer(
        args.model,
        device=args.device,
        dtype=args.dtype,
        batch_size=args.model_batch_size,
        batch_tokens=args.model_batch_tokens,
        max_length=args.max_length,
        normalize=args.normalize,
    )


def _check_model_extra() -> None:
    """Raise ValueError (exit status 2, one line) when the packages of the reward-model backend
    are missing. They are an extra, and without this check a scoring process died on
    `import torch`."""
    missing = [name for name in MODEL_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"--model needs the [model] extra ({' and '.join(missing)} not installed): install "
            "'ferrule-rewards[model]' (in a clone: pip install './packages/rewards[model]')"
        )


def _serve(args) -> None:
    from ferrule_rewards.processes import StartFailed
    from ferrule_rewards.server import Limits, serve

    if args.model:  # before anything starts
        _check_model_extra()
    token, tls = server_security(args, token_env=TOKEN_ENV)
    limits = Limits(
        max_batch=args.max_batch,
        max_message_bytes=int(args.max_message_mb * (1 << 20)),
        max_concurrency=args.max_concurrency,
        call_timeout=args.call_timeout,
        max_log_bytes=int(args.max_log_mb * (1 << 20)),
        max_sub_scores=args.max_sub_scores,
        max_connections_per_peer=args.max_connections_per_peer,
    )
    options = {"grace": args.grace, "token": token, "tls": tls, "limits": limits}
    options["address_file"] = args.address_file
    options["processes"] = args.processes
    if args.workers == 1:
        try:
            cut_off = asyncio.run(serve(partial(make_scorer, args), args.bind, **options))
        except StartFailed as error:
            print(f"rlhf-rewards serve: error: {error}", file=sys.stderr)
            sys.exit(error.status)
        sys.exit(1 if cut_off else 0)
    from ferrule_rewards.workers import WorkerFailed, supervise

    try:
        supervise(
            partial(make_scorer, args),
            args.bind,
            workers=args.workers,
            log_level=args.log_level,
            **options,
        )
    except WorkerFailed as error:
        print(f"rlhf-rewards serve: error: {error}", file=sys.stderr)
        sys.exit(error.status)


def _client(args):
    from ferrule_rewards.client import RewardClient

    return RewardClient(
        args.addresses,
        **client_security(args, token_env=TOKEN_ENV),
        timeout=args.timeout,
        retry_for=args.connect_timeout,
    )


def _health(args) -> None:
    with _client(args) as client:
        answers = client.health(timeout=args.timeout)
    print(json.dumps(answers))
    if any(answer != "SERVING" for answer in answers.values()):
        sys.exit(1)


def _score(args) -> None:
    from ferrule_rewards.client import InvalidSample

    samples, numbers = [], []  # numbers: the stdin line of each sample (blank lines skipped)
    for number, line in enumerate(sys.stdin, 1):
        if line.strip():
            try:
                samples.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"stdin line {number}: not JSON: {error}") from None
            numbers.append(number)
    failed = 0
    with _client(args) as client:
        try:
            results = client.score(samples)
        except InvalidSample as error:
            raise ValueError(f"stdin line {numbers[error.index]}: {error.message}") from None
        for result in results:
            line = {"reward": result.reward if result.ok else None, "status": str(result.status)}
            failed += not result.ok
            if result.error:
                line["error"] = result.error
            if result.sub_scores:
                line["sub_scores"] = result.sub_scores
            print(json.dumps(line))
    if failed and not args.allow_failed:  # so that a script never takes failures for rewards
        sys.stdout.flush()
        sys.exit(f"rlhf-rewards score: {failed} of {len(samples)} samples failed")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf-rewards", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_arguments(commands.add_parser("serve", help="run the reward server"))
    score = commands.add_parser("score", help="score JSON lines from stdin")
    _client_arguments(score)
    score.add_argument(
        "--allow-failed",
        action="store_true",
        help="exit 0 even when samples failed (default: exit 1 when any did; every line is "
        "printed either way)",
    )
    _client_arguments(commands.add_parser("health", help="check servers' health"))
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    args = parser.parse_args(argv)
    logs.configure(args.log_level)  # via a queue, so a stderr that nobody reads never blocks
    try:
        {"serve": _serve, "score": _score, "health": _health}[args.command](args)
    except RewardServersUnavailable as error:
        hint = "(--connect-timeout sets how long to keep trying)"
        parser.exit(2, f"rlhf-rewards {args.command}: error: {error} {hint}\n")
    except (ValueError, TypeError, OSError, RewardError) as error:
        parser.exit(2, f"rlhf-rewards {args.command}: error: {error}\n")


if __name__ == "__main__":
    main()
