"""Load a run's config: validate each table of the file, then check the rules that span tables.

    config = load_config("examples/tiny.toml")      # raises ConfigError naming file, table, key
    print(config.rollout.samples_per_prompt)
    config = resolve(config).config                 # resolve.py: fitted to this machine's GPUs

All errors are reported at once, one line each: `tiny.toml: [rollout] temperature: Input should
be greater than 0, got -1`. The cross-table rules (checks.py) run only after every table is
valid, because a contradiction between tables means little while one of the tables is broken.
"""

from pathlib import Path

from ferrule_config import ConfigError, format_problems
from ferrule_config import load_config as load_file
from ferrule_launcher import checks
from ferrule_launcher.config import Config


def load_config(path: str | Path, overrides: dict | None = None) -> Config:
    """Read and validate a run's TOML file. Overrides such as {"loop.steps": 3} take precedence
    over the file. Only the file and the files it names are read; resolve.resolve then fits the
    result to a machine."""
    config = load_file(path, Config, overrides)
    config._source = str(path)
    problems = checks.problems(config)
    if problems:
        raise ConfigError(format_problems(path, problems))
    return config
