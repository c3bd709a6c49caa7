"""ferrule-config: TOML files of typed tables with one error format (tables.py), and
`module:name` specs that name a user's Python objects (objects.py).

The names from tables.py are imported on first use. `ferrule_config.objects` uses only the
standard library, and the reward server imports it, so importing it must not load pydantic
with the tables.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them
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


def __getattr__(name: str) -> object:
    """A name of tables.py, imported when first asked for (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ferrule_config import tables

    value = getattr(tables, name)
    globals()[name] = value  # found directly from now on
    return value
