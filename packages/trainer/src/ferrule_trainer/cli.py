"""The `rlhf-train` command: training entry points that run without the launcher.

    rlhf-train sft config.toml        # supervised fine-tuning (sft.py documents the config)
    rlhf-train rm config.toml         # a Bradley-Terry reward model on preference pairs (rm.py)
    rlhf-train dpo config.toml        # DPO / IPO / conservative DPO on preference pairs (dpo.py)

The command runs in one process by default. Under torchrun or the deepspeed launcher, every rank
runs it. A bad config or data file makes it exit with status 2 and an error that names the file
and either the table and key or the line.
"""

import argparse
import importlib
import sys

from ferrule_config import ConfigError, load_config

COMMANDS = {  # name: (module, config class, help)
    "sft": ("sft", "SFTConfig", "supervised fine-tuning on JSONL prompt/response pairs"),
    "rm": ("rm", "RMConfig", "reward-model training on JSONL preference pairs"),
    "dpo": ("dpo", "DPOConfig", "DPO on JSONL preference pairs, against a frozen reference"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf-train", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, _, text) in COMMANDS.items():
        command = commands.add_parser(name, help=text)
        command.add_argument("config", help=f"TOML file (ferrule_trainer/{module}.py documents it)")
    args = parser.parse_args(argv)

    module_name, config_class, _ = COMMANDS[args.command]
    module = importlib.import_module(f"ferrule_trainer.{module_name}")
    try:
        config = load_config(args.config, getattr(module, config_class))
    except ConfigError as error:
        print(f"rlhf-train: {error}", file=sys.stderr)
        return 2
    try:
        module.train(config)
    except ValueError as error:  # bad data: a line that is not JSON, a missing key, too few rows
        print(f"rlhf-train {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
