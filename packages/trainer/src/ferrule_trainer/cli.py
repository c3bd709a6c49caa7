"""The `rlhf-train` command: training entry points that run without the launcher.

    rlhf-train sft config.toml        # supervised fine-tuning (sft.py documents the config)

Runs in one process by default; under torchrun or the deepspeed launcher every rank runs it.
"""

import argparse
import sys

from ferrule_trainer.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf-train", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sft = commands.add_parser("sft", help="supervised fine-tuning on JSONL prompt/response pairs")
    sft.add_argument("config", help="TOML file with [model], [data], [train], [output] tables")
    args = parser.parse_args(argv)

    if args.command == "sft":
        from ferrule_trainer.sft import SFTConfig, train

        try:
            config = load_config(args.config, SFTConfig)
        except ConfigError as error:
            print(f"rlhf-train: {error}", file=sys.stderr)
            return 2
        train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
