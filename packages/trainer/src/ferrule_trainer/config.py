"""TOML run configs as typed dataclasses: one table per dataclass field, unknown keys are errors.

    config = load_config("sft.toml", SFTConfig)   # SFTConfig: a dataclass of table dataclasses

Every error names the file, the table and the key (`sft.toml: [train] lr is not a known key;
known: ...`), before anything heavy starts. Standard library only.
"""

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file that does not match its schema; the message names the file and key."""


def load_config(path: str | Path, schema: type[T]) -> T:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    return _build(schema, data, path, "")


def _build(schema: type, data: Any, path: Path, where: str):
    label = f"[{where}]" if where else "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {label} must be a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: {label} has unknown key(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(schema)
    values = {}
    for name, field in fields.items():
        key = f"{where}.{name}" if where else name
        if name not in data:
            no_default = field.default is dataclasses.MISSING
            if no_default and field.default_factory is dataclasses.MISSING:
                raise ConfigError(
                    f"{path}: [{where}] {name} is required"
                    if where
                    else f"{path}: table [{name}] is required"
                )
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, data[name], path, key)
        else:
            values[name] = _check(hint, data[name], path, where, name)
    try:
        return schema(**values)
    except ValueError as error:  # a __post_init__ range check
        raise ConfigError(f"{path}: [{where}] {error}") from None


def _check(hint: Any, value: Any, path: Path, where: str, name: str) -> Any:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return value
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is bool and isinstance(value, bool):
            return value
        if kind in (int, str) and isinstance(value, kind) and not isinstance(value, bool):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise ConfigError(f"{path}: [{where}] {name} must be {names}, got {value!r}")
