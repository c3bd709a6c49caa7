"""Ferrule's one config system: TOML files of typed tables, one error format.

    config = load_config("run.toml", Config)     # raises ConfigError naming file, table, key

Every entry point (`rlhf-train sft`, `rlhf-launch`) reads its file with `load_config` and gets
errors of one form, all of them at once, before anything heavy starts:

    sft.toml: [train] lr: unknown key (known: batch_size, epochs, ...)
    run.toml: [trainer] kl_kind: "k1" has zero gradient in expectation as a loss term; ...

A table is a pydantic model (`Table`) with a docstring under each field. Paths read by a run
(`InputPath`) are relative to the TOML file. A check that spans keys raises `Problems` from a
model validator, naming each key it blames. This is a package of its own (pydantic only), so
that every other package can read a table without depending on the package that defines
another table.
"""

import tomllib
from pathlib import Path
from typing import Annotated, ClassVar, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    model_validator,
)

T = TypeVar("T", bound=BaseModel)

RENAMED_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""Old dtype names, mapped to their new names. Tables took the old names before all of them
used one vocabulary (0.1.0 of 2026-11-23)."""


def renamed_dtype(value):
    """A before-validator for dtype keys: it refuses an old name and gives the new one."""
    if value in RENAMED_DTYPES:
        raise ValueError(f"{value!r} was renamed: use {RENAMED_DTYPES[value]!r}")
    return value


class ConfigError(ValueError):
    """The configuration is wrong; each line names the file, the table and the key."""


class Problems(ValueError):
    """Settings that are each valid but contradict one another: [(key, message), ...], where
    key is "table.key" from the top-level model, or "key" from a table's own validator."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(message for _, message in problems))
        self.problems = problems


class Table(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    renamed: ClassVar[dict[str, str]] = {}
    """Keys that this table no longer reads, as {old key: what to write instead}. The error for
    such a key gives that text instead of "unknown key", with "{value}" replaced by the value in
    the file."""

    @model_validator(mode="before")
    @classmethod
    def _none_from_toml(cls, data):
        """TOML has no null, so the string "none" sets a key that may be None to None
        (dual_clip = "none"). `describe` writes None the same way."""
        if not isinstance(data, dict):
            return data
        return {
            key: None if value == NONE and _may_be_none(cls, key) else value
            for key, value in data.items()
        }


NONE = "none"
"""The string that stands for None in a TOML file (and in what `describe` writes)."""


def _may_be_none(table: type[BaseModel], key: str) -> bool:
    field = table.model_fields.get(key)
    return field is not None and type(None) in get_args(field.annotation)


def _near_the_file(path: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base")
    return path if path.is_absolute() or base is None else (base / path).resolve()


InputPath = Annotated[Path, AfterValidator(_near_the_file)]
"""A path that the run reads. A relative path is taken from the folder of the TOML file."""


# -- loading ----------------------------------------------------------------------------------


def load_config(
    path: str | Path, schema: type[T], overrides: dict | None = None, context: dict | None = None
) -> T:
    """Read and validate `path` as `schema`. `overrides` ({"table.key": value}) win over the
    file. `context` reaches the validators, together with "base", the file's folder. All the
    problems found are raised together, in one ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    for key, value in (overrides or {}).items():
        table, _, name = key.partition(".")
        data.setdefault(table, {})[name] = value
    try:
        context = {**(context or {}), "base": path.resolve().parent}
        return schema.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(format_errors(path, schema, err)) from None


def format_errors(path: Path, schema: type[BaseModel], err: ValidationError) -> str:
    """One line per problem: `file: [table] key: message`."""
    lines = []
    for e in err.errors():
        loc = [str(part) for part in e["loc"]]
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, Problems):
            for key, message in cause.problems:
                lines.append(f"{path}: {_where(loc + key.split('.'))}: {message}")
            continue
        table = _table(schema, loc[:-1])
        if e["type"] == "extra_forbidden" and loc[-1] in getattr(table, "renamed", {}):
            message = table.renamed[loc[-1]].format(value=_toml(e["input"]))
        elif e["type"] == "extra_forbidden":
            message = "unknown key" if len(loc) > 1 else "unknown table"
            if table is not None:
                message += f" (known: {', '.join(sorted(table.model_fields))})"
        elif e["type"] == "missing":
            message = "is required"
        elif e["type"] == "value_error":  # our own checks: the message says it all
            message = str(cause)
        else:
            message = f"{e['msg']}, got {e['input']!r}"
        lines.append(f"{path}: {_where(loc)}: {message}")
    return "\n".join(lines)


def format_problems(path: Path | str, problems: list[tuple[str, str]]) -> str:
    """Problems found after loading (a check that reads more than the file), in the format of
    format_errors: `file: [table] key: message`."""
    return "\n".join(f"{path}: {_where(key.split('.'))}: {message}" for key, message in problems)


def _where(loc: list[str]) -> str:
    if not loc:  # a check across the whole file that named no key
        return "the file as a whole"
    if len(loc) == 1:
        return f"table [{loc[0]}]"
    return f"[{loc[0]}] {'.'.join(loc[1:])}"


def _table(schema: type[BaseModel], tables: list[str]) -> type[BaseModel] | None:
    """The model of the table at `tables` (["task"] -> TaskConfig); None where there is none."""
    model: type[BaseModel] | None = schema
    for name in tables:
        field = model.model_fields.get(name) if model else None
        annotation = field.annotation if field else None
        model = next(
            (
                a
                for a in getattr(annotation, "__args__", (annotation,))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
    return model


def describe(config: BaseModel, shown: dict[str, dict] | None = None) -> str:
    """Render a validated configuration as TOML (resolved paths, defaults filled in), for
    --dry-run. `shown` ({table: {key: value}}) replaces what some keys show, e.g. a value that
    is still to be resolved."""
    lines = []
    for table, value in config.model_dump(mode="json").items():
        if value is None:
            continue
        value = {**value, **(shown or {}).get(table, {})}
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml(item)}" for key, item in value.items()]
        lines.append("")
    return "\n".join(lines)


def _toml(value) -> str:
    if value is None:
        return f'"{NONE}"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)
