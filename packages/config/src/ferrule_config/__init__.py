"""ferrule-config: TOML files of typed tables, one error format (see tables.py)."""

from ferrule_config.tables import (
    NONE,
    RENAMED_DTYPES,
    ConfigError,
    InputPath,
    Problems,
    Table,
    describe,
    format_errors,
    format_problems,
    load_config,
    renamed_dtype,
)

__all__ = [
    "NONE",
    "RENAMED_DTYPES",
    "ConfigError",
    "InputPath",
    "Problems",
    "Table",
    "describe",
    "format_errors",
    "format_problems",
    "load_config",
    "renamed_dtype",
]
