"""`rlhf-launch CONFIG.toml`: run Ferrule's RL loop (PPO family) on Ray from one TOML file.

    rlhf-launch examples/tiny.toml                    # SFT warm start, then GRPO, on CPU
    rlhf-launch examples/tiny.toml --dry-run          # check and print the resolved config
    rlhf-launch examples/grpo-gsm8k-gpu.toml --plan   # what each GPU will hold
    rlhf-launch examples/tiny.toml --resume           # continue after a crash or kill -9
    rlhf-launch examples/tiny.toml --set loop.steps=5 --set output.dir=\"runs/short\"

The configuration is checked completely before any process starts. Errors name the file, the
table and the key, and exit with status 2. A failed run exits with status 1, Ctrl-C with 130.
"""

import argparse
import sys
import tomllib
from pathlib import Path

from ferrule_launcher import __version__


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ferrule_launcher.config import Config  # imports only pydantic, so --help stays quick

    tables = " ".join(f"[{name}]" for name in Config.model_fields)
    parser = argparse.ArgumentParser(
        prog="rlhf-launch",
        description="Run Ferrule's RLHF loop (rollout -> rewards -> train -> weight sync) on Ray "
        "from one TOML config file.",
        epilog=f"Tables: {tables}; every key with its type, default and meaning: docs/config.md. "
        "Submit to a running cluster with `ray job submit --working-dir . -- rlhf-launch "
        'config.toml` and [ray] address = "auto".',
    )
    parser.add_argument("config", type=Path, help="the run's TOML file, e.g. examples/tiny.toml")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate, print the resolved config and exit"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help='print the memory plan (what each GPU holds per phase, the "auto" keys chosen) '
        "and exit",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint in [output] dir (start over if there is none)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override one key (VALUE in TOML syntax, e.g. loop.steps=5); repeatable",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser.parse_args(argv)


def parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {item!r}: expected TABLE.KEY=VALUE, e.g. loop.steps=5")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = value  # not TOML: take it as a bare string
    return overrides


def main(argv: list[str] | None = None) -> int:
    from ferrule_launcher.config import ConfigError, describe
    from ferrule_launcher.data import make_prompts
    from ferrule_launcher.load import load_config
    from ferrule_launcher.resolve import resolve

    args = parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        if args.plan:  # show the plan even when it does not fit, instead of only refusing it
            return print_plan(resolve(load_config(args.config, overrides), refuse=False).plan)
        resolved = resolve(load_config(args.config, overrides), dry_run=args.dry_run)
        config, unplanned = resolved.config, resolved.unplanned
        prompts = make_prompts(config)  # data files are read and checked here, before any process
    except (ConfigError, ValueError) as err:
        print(f"rlhf-launch: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"# {args.config}: configuration is valid; resolved values:\n")
        print(describe(config, {"trainer": dict.fromkeys(unplanned, "auto")}))
        print(f"\n# prompts: {prompts.describe()}")
        if unplanned:
            print(
                f'# [trainer] {", ".join(sorted(config.trainer.auto))} stay "auto": this machine '
                "shows no GPU. The memory plan for GPUs of a given size: rlhf-launch "
                f"{args.config} --plan --set ray.gpu_memory_gb=80"
            )
        return 0

    from ferrule_launcher.outputs import describe_eval
    from ferrule_launcher.run import RunError, run

    try:
        summary = run(config, resume=args.resume, prompts=prompts)
    except KeyboardInterrupt:
        print(
            "rlhf-launch: interrupted; every process the run started was stopped", file=sys.stderr
        )
        return 130
    except RunError as err:
        print(f"rlhf-launch: error: {err}", file=sys.stderr)
        return 1
    keys = ("accuracy_before", "accuracy_after", "steps", "wall_seconds")
    print("summary: " + ", ".join(f"{k} = {summary[k]}" for k in keys if k in summary))
    print(f"held-out before RL: {describe_eval(summary['eval_before'])}")
    print(f"held-out after RL:  {describe_eval(summary['eval_after'])}")
    return 0


def print_plan(plan) -> int:
    """--plan: what each GPU holds per phase; exit status 2 when it does not fit."""
    if plan is None:
        print("no memory plan: a CPU run ([ray] gpus_per_role = 0)")
        return 0
    print(plan.describe())
    return 0 if plan.fits() else 2


if __name__ == "__main__":
    sys.exit(main())
