"""Regenerate the Python code of every .proto under proto/ into the package that owns it.

    uv run python scripts/gen_protos.py           # rewrite the generated files
    uv run python scripts/gen_protos.py --check   # exit 1 if a committed file is stale (CI)
    uv run python scripts/gen_protos.py --check proto/ferrule/rewards   # only these protos

`proto/ferrule/<name>/v<N>/<file>.proto` belongs to `packages/<name>/src/ferrule_<name>/`, which
receives `<file>_pb2.py`, `<file>_pb2.pyi` and `<file>_pb2_grpc.py`. protoc writes imports after
the proto package (`from ferrule.rewards.v1 import rewards_pb2`), which is no Python package of
ours; those lines are rewritten to the owning package (`from ferrule_rewards import rewards_pb2`).
The descriptors keep their full proto paths, so reflection and other languages see the real names.
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# `from ferrule.<name>.v<N> import x_pb2` and `import ferrule.<name>.v<N>.x_pb2`.
IMPORT_FROM = re.compile(r"^from ferrule\.(\w+)\.v\d+ import ", re.MULTILINE)
IMPORT_PLAIN = re.compile(r"^import ferrule\.(\w+)\.v\d+\.(\w+_pb2) as ", re.MULTILINE)


def owning_package(proto: Path) -> Path:
    """The source folder of the package that serves `proto` (a path under proto/)."""
    parts = proto.relative_to(PROTO_ROOT).parts
    if len(parts) != 4 or parts[0] != "ferrule" or not re.fullmatch(r"v\d+", parts[2]):
        raise SystemExit(f"{proto}: expected proto/ferrule/<name>/v<N>/<file>.proto")
    package = ROOT / "packages" / parts[1] / "src" / f"ferrule_{parts[1]}"
    if not package.is_dir():
        raise SystemExit(f"{proto}: no package folder {package.relative_to(ROOT)} to own it")
    return package


def fix_imports(text: str) -> str:
    text = IMPORT_FROM.sub(r"from ferrule_\1 import ", text)
    return IMPORT_PLAIN.sub(r"import ferrule_\1.\2 as ", text)


def outputs_of(proto: Path) -> list[Path]:
    return [owning_package(proto) / f"{proto.stem}{suffix}" for suffix in GENERATED_SUFFIXES]


def generate(protos: list[Path]) -> dict[Path, str]:
    """Run protoc on `protos`; return {destination path: file text}."""
    from grpc_tools import protoc  # dev dependency; imported here so --help works without it

    # protoc's own include folder (google/protobuf/*.proto) ships inside grpc_tools.
    includes = Path(protoc.__file__).parent / "_proto"
    outputs = {}
    with tempfile.TemporaryDirectory() as out:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{includes}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (its error is above)")
        for proto in protos:
            generated = Path(out) / proto.relative_to(PROTO_ROOT).parent
            for path in outputs_of(proto):
                outputs[path] = fix_imports((generated / path.name).read_text())
    return outputs


def stale_files(outputs: dict[Path, str], expected: set[Path]) -> list[Path]:
    """Generated files that differ from what protoc makes now or are missing, and, in the
    same packages, generated files that no proto makes any more (`expected` is every output
    of every proto)."""
    stale = [
        path for path, text in outputs.items() if not path.exists() or path.read_text() != text
    ]
    for package in {path.parent for path in outputs}:
        for path in package.iterdir():
            if path.name.endswith(GENERATED_SUFFIXES) and path not in expected:
                stale.append(path)
    return sorted(stale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    parser.add_argument("paths", nargs="*", type=Path, help="protos or folders (default: proto/)")
    args = parser.parse_args()
    every = sorted(PROTO_ROOT.rglob("*.proto"))
    chosen = [p.resolve() for p in args.paths] or [PROTO_ROOT]
    protos = [p for p in every if any(p == c or c in p.parents for c in chosen)]
    if not protos:
        raise SystemExit(f"no .proto files under {', '.join(map(str, chosen))}")
    outputs = generate(protos)
    stale = stale_files(outputs, {path for proto in every for path in outputs_of(proto)})
    if args.check:
        if stale:
            names = "\n  ".join(str(path.relative_to(ROOT)) for path in stale)
            sys.exit(
                f"generated protobuf code is stale:\n  {names}\n"
                "run `uv run python scripts/gen_protos.py` and commit the result"
            )
        print(f"generated protobuf code is up to date ({len(outputs)} files)")
        return
    for path in stale:
        if path in outputs:
            path.write_text(outputs[path])
            print(f"wrote {path.relative_to(ROOT)}")
        else:
            path.unlink()
            print(f"removed {path.relative_to(ROOT)} (its .proto is gone)")
    if not stale:
        print(f"generated protobuf code is up to date ({len(outputs)} files)")


if __name__ == "__main__":
    main()
