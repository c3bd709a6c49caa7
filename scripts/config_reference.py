"""Write docs/config.md, every table and key of every TOML config, from the pydantic models.

    uv run python scripts/config_reference.py           # rewrite docs/config.md
    uv run python scripts/config_reference.py --check   # exit 1 if docs/config.md is stale

Each key's type and constraints come from its annotation and `Field(...)`, its default from the
model (or from the default table the top-level model gives, e.g. `rlhf-launch`'s [sft] steps =
0), and its text from the docstring under the field. A key without a docstring is an error.
"""

import argparse
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "config.md"
# (command, import path of the top-level model, the module that documents it)
ENTRY_POINTS = [
    ("rlhf-launch CONFIG.toml", "ferrule_launcher.config:Config", "ferrule_launcher/config.py"),
    ("rlhf-train sft CONFIG.toml", "ferrule_trainer.sft:SFTConfig", "ferrule_trainer/sft.py"),
    ("rlhf-train rm CONFIG.toml", "ferrule_trainer.rm:RMConfig", "ferrule_trainer/rm.py"),
    ("rlhf-train dpo CONFIG.toml", "ferrule_trainer.dpo:DPOConfig", "ferrule_trainer/dpo.py"),
]
BOUNDS = {  # constraint class: (symbol, its attribute)
    annotated_types.Ge: (">=", "ge"),
    annotated_types.Gt: (">", "gt"),
    annotated_types.Le: ("<=", "le"),
    annotated_types.Lt: ("<", "lt"),
}


def load(spec: str) -> type[BaseModel]:
    module, _, name = spec.partition(":")
    return getattr(__import__(module, fromlist=[name]), name)


def type_name(annotation) -> str:
    """A TOML reader's name for a Python annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (' \\| "none"' if type(None) in args else "")
    if origin in (list, tuple):
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        if origin is tuple:
            return "[" + ", ".join(type_name(a) for a in args) + "]"
        return f"list of {type_name(args[0])}"
    if origin is dict or annotation is dict:
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    return {str: "string", int: "integer", float: "float", bool: "boolean"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def constraints(field) -> str:
    metadata = list(field.metadata)
    for arg in typing.get_args(field.annotation):  # int | "auto": the bounds sit on the int
        if typing.get_origin(arg) is typing.Annotated:
            for m in typing.get_args(arg)[1:]:
                metadata += getattr(m, "metadata", [m])
    return ", ".join(
        f"{BOUNDS[type(m)][0]} {getattr(m, BOUNDS[type(m)][1])}"
        for m in metadata
        if type(m) in BOUNDS
    )


def toml_value(value) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | Path):
        return f'"{value}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def table_model(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The model of a table field and whether it is an array of tables ([[name]])."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, False
        inner = typing.get_args(arg)
        if typing.get_origin(arg) is list and inner and issubclass(inner[0], BaseModel):
            return inner[0], True
    return None, False


def one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def table_section(name: str, model, default, array: bool, required: bool, out: list[str]):
    """Markdown for one table (and, after it, its arrays of tables)."""
    heading = f"[[{name}]]" if array else f"[{name}]"
    out += [f"### `{heading}`", ""]
    if model.__doc__:
        out += [one_line(model.__doc__), ""]
    if required:
        out += ["This table is required.", ""]
    elif default is None and not array:
        out += ["Optional: leave the table out to turn it off.", ""]
    rows, nested = [], []
    for key, field in model.model_fields.items():
        sub, sub_array = table_model(field.annotation)
        if sub_array:
            nested.append((f"{name}.{key}", sub))
        if not field.description:
            raise SystemExit(f"{model.__name__}.{key}: no docstring under the field")
        if default is not None and key in getattr(default, "auto", ()):
            value = toml_value("auto")  # the instance holds what "auto" becomes without GPUs
        elif default is not None:
            value = toml_value(getattr(default, key))
        elif field.is_required():
            value = "required"
        elif field.default_factory is not None:
            value = toml_value(field.default_factory())
        else:
            value = toml_value(None if field.default is PydanticUndefined else field.default)
        kind = f"tables: [[{name}.{key}]] below" if sub_array else type_name(field.annotation)
        bound = constraints(field)
        rows.append(
            f"| `{key}` | {kind}{f' ({bound})' if bound else ''} | "
            f"{value if value == 'required' else f'`{value}`'} | {one_line(field.description)} |"
        )
    out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for sub_name, sub in nested:
        table_section(sub_name, sub, None, True, False, out)


def reference() -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/config_reference.py from the pydantic models; do not edit. -->",
        "",
        "Every TOML table and key Ferrule reads, with its type, default and meaning, generated",
        "from the config models (`uv run python scripts/config_reference.py` rewrites this file;",
        "CI fails when it is stale). Unknown keys are errors that name the key; a renamed key's",
        "error says what replaced it. Paths a run reads are relative to the TOML file;",
        'a key that may be off takes `"none"` (TOML has no null).',
        "",
    ]
    out += ["Commands:", ""]
    for command, spec, _ in ENTRY_POINTS:
        anchor = command.split(" CONFIG")[0].replace(" ", "-")
        out.append(f"- [`{command}`](#{anchor}): `{spec.replace(':', '.')}`")
    out.append("")
    for command, spec, module in ENTRY_POINTS:
        top = load(spec)
        out += [f"## {command.split(' CONFIG')[0]}", ""]
        out += [f"`{command}` reads these tables (`{module}`).", ""]
        for name, field in top.model_fields.items():
            model, array = table_model(field.annotation)
            default = None if field.is_required() else field.default
            table_section(name, model, default, array, field.is_required(), out)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args()
    text = reference()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: run `uv run python "
                "scripts/config_reference.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
