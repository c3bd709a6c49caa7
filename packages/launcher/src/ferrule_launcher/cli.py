"""`rlhf-launch CONFIG.toml`: the command that runs the whole Ferrule RLHF loop.

The RL loop itself lands with issue 7; until then the command parses and checks its arguments,
reads the TOML file, and exits with status 2 and a message that says what is missing.
"""

import argparse
import sys
import tomllib
from pathlib import Path

from ferrule_launcher import __version__

NOT_YET = (
    "rlhf-launch {version}: read {path} ({tables}). The RL loop (rollout -> rewards -> train -> "
    "weight sync) is not implemented in this version yet; it lands with the launcher issue (#7)."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlhf-launch", description="Run Ferrule's RLHF loop from one TOML config file."
    )
    parser.add_argument("config", type=Path, help="the run's TOML file, e.g. examples/tiny.toml")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.config.is_file():
        print(f"rlhf-launch: config file {args.config} does not exist", file=sys.stderr)
        return 2
    try:
        config = tomllib.loads(args.config.read_text())
    except tomllib.TOMLDecodeError as err:
        print(f"rlhf-launch: {args.config} is not valid TOML: {err}", file=sys.stderr)
        return 2
    tables = ", ".join(f"[{name}]" for name in config) or "no tables"
    print(NOT_YET.format(version=__version__, path=args.config, tables=tables), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
