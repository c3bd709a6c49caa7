"""Take DeepSpeed, Ray and Ferrule's own packages to the GPU machines, as wheels.

The GPU machines (see the shared ENVIRONMENT.md, "The GPU machines") have Python 3.12, torch
2.11+cu130, transformers and a few more, but no DeepSpeed, no Ray and no network. A run there
works on a copy of the working tree and may carry ignored paths along, 64 MiB in all. This script
makes that carry-along: a folder of cp312 wheels, at most 60 MiB.

Here (the development machine, which has the network):

    python scripts/gpu_bundle.py build                    # into .gpu-bundle/ (git-ignored)
    python scripts/gpu_bundle.py build --with tensorboard --without grpcio

    Downloads every third-party wheel at the version uv.lock pins (pip download --no-deps
    --only-binary=:all: --python-version 3.12 --platform manylinux_2_28/2014_x86_64), builds
    DeepSpeed's pure-Python wheel from its sdist, rewrites the Ray wheel without ray/jars/ (the Java
    workers, 31 MiB) and the *.js.map files (RECORD fixed to match, so pip accepts it), and
    builds the workspace packages (uv build --all-packages) from the current sources. A wheel
    already in the folder is kept (the workspace wheels are rebuilt every time). Prints the
    wheels and the total; fails if the total is over 60 MiB. Groups of wheels:
      core         always: deepspeed, hjson, einops, py-cpuinfo, pydantic (+ pydantic-core,
                   annotated-types, typing-inspection, typing-extensions), ray (trimmed),
                   jsonschema, jsonschema-specifications, referencing, rpds-py, tqdm,
                   protobuf, grpcio-health-checking, grpcio-reflection, ferrule-* (7 wheels)
      grpcio       on by default (7 MiB): the committed *_pb2_grpc.py need grpcio >= 1.85.1;
                   leave it out (--without grpcio) if `check` shows the image has that
      tensorboard  off by default (5.4 MiB): tensorboard + absl-py, for torch.utils.tensorboard
                   ([output] tensorboard = true, the launcher's default)
      matplotlib   off by default (24 MiB with pillow and fonttools; does not fit next to
                   Ray): the launcher's reward_curve.png at the end of a run
    --slim-ray also leaves out ray/rllib, ray/data, ray/serve, ray/llm and the dashboard's web
    client (5 MiB), which the launcher never imports. Sizes (2026-11-23): default 56.5 MiB;
    --slim-ray --with tensorboard 56.9 MiB. Build right before a GPU run: `install` warns when
    packages/ no longer matches the sources the ferrule-* wheels were built from. With the
    device tool: run(carry=[".gpu-bundle"], command=". scripts/gpu_env.sh && ...").

There (the GPU machine), from the repository root, with .gpu-bundle carried along:

    . scripts/gpu_env.sh       # the settings below + install into .gpu-site + PYTHONPATH
    # or by hand:
    python scripts/gpu_bundle.py install --target .gpu-site
    export PYTHONPATH=$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH} PATH=$PWD/.gpu-site/bin:$PATH
    python scripts/gpu_bundle.py check [--ray-smoke]

    `install [--from .gpu-bundle] [--target DIR] [--force]` pip-installs (--no-deps --no-index
    --no-compile) every wheel whose distribution is missing or older than the bundled one
    (pydantic and pydantic-core go together), into the running interpreter or into DIR, which
    must then be on PYTHONPATH (exported, so that Ray's worker processes see it too; the launcher
    passes PYTHONPATH on to its roles). A ferrule-* wheel is reinstalled when its files differ
    from the installed ones (their version does not change with the code). Without pip it
    unpacks the wheels itself. Makes Ray's raylet and gcs_server executable. With --target it
    then writes DIR's bytecode, as a user's `uv sync` would (what is up to date is skipped).
    Where the interpreter writes no bytecode itself (PYTHONDONTWRITEBYTECODE, as on the GPU
    machines), it also writes that of the interpreter's own site-packages, once per machine
    (torch came without it there: each role's process compiled it at every start).
    A second run with nothing to do takes a few seconds (1.9 s of CPU to check 3,500 modules).
    `check [--target DIR] [--ray-smoke]` imports deepspeed, ray and the ferrule packages and
    prints their versions, then what else the launcher needs (grpc >= 1.85.1, protobuf >= 7.35.1,
    tqdm, matplotlib, tensorboard) and the settings below; exits 1 if a required import fails.
    --ray-smoke also starts a local Ray cluster and places an actor (a few seconds).

Settings the GPU machines need (scripts/gpu_env.sh exports them):
    TORCH_CUDA_ARCH_LIST=9.0        the image says 9.0a, on which DeepSpeed's op builder fails
    RAY_USAGE_STATS_ENABLED=0       (a first Ray start without it hung past 300 s)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   (multi-GPU)

Standard library only; `build` needs pip and uv, `install` runs on CPython 3.12.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".gpu-bundle"
LOCK = ROOT / "uv.lock"
LIMIT_MIB = 60.0
MIB = 1024 * 1024
TARGET_PYTHON = (3, 12)
TARGET_PY = "{}.{}".format(*TARGET_PYTHON)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
MANIFEST = "manifest.json"

# Third-party distributions: (name, group). Versions come from uv.lock.
THIRD_PARTY = [
    ("deepspeed", "core"),  # sdist only: built here, pure Python
    ("hjson", "core"),
    ("einops", "core"),
    ("py-cpuinfo", "core"),
    ("pydantic", "core"),
    ("pydantic-core", "core"),
    ("annotated-types", "core"),
    ("typing-inspection", "core"),
    ("typing-extensions", "core"),
    ("ray", "core"),  # trimmed
    ("jsonschema", "core"),
    ("jsonschema-specifications", "core"),
    ("referencing", "core"),
    ("rpds-py", "core"),
    ("tqdm", "core"),
    ("protobuf", "core"),
    ("grpcio-health-checking", "core"),
    ("grpcio-reflection", "core"),
    ("grpcio", "grpcio"),
    ("tensorboard", "tensorboard"),
    ("absl-py", "tensorboard"),
    ("matplotlib", "matplotlib"),
    ("contourpy", "matplotlib"),
    ("cycler", "matplotlib"),
    ("fonttools", "matplotlib"),
    ("kiwisolver", "matplotlib"),
    ("pillow", "matplotlib"),
    ("pyparsing", "matplotlib"),
    ("python-dateutil", "matplotlib"),
    ("tzdata", "matplotlib"),
]
GROUPS = {"core": True, "grpcio": True, "tensorboard": False, "matplotlib": False}
SDIST_ONLY = {"deepspeed"}
WORKSPACE_PREFIX = "ferrule-"
# pydantic pins pydantic-core exactly: the core follows whichever pydantic is used.
LINKED = {"pydantic": ["pydantic-core"]}

RAY_DROP_ALWAYS = ("ray/jars/",)
RAY_DROP_SUFFIXES = (".js.map",)
RAY_DROP_SLIM = ("ray/rllib/", "ray/data/", "ray/serve/", "ray/llm/", "ray/dashboard/client/build/")
RAY_BINARIES = ("ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server")

# Offline, exactly these files: nothing resolved, downloaded or byte-compiled.
PIP_INSTALL = [
    sys.executable,
    "-m",
    "pip",
    "--isolated",
    "install",
    "--no-deps",
    "--no-index",
    "--no-compile",
    "--disable-pip-version-check",
    "--no-warn-script-location",
    "--quiet",
]


# ---------------------------------------------------------------------------------------------
# Small helpers


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path | str) -> tuple[str, str]:
    parts = Path(path).name[: -len(".whl")].split("-")
    return normalize(parts[0]), parts[1]


def _release(version: str) -> tuple[int, ...] | None:
    m = re.match(r"^v?(\d+(?:\.\d+)*)$", version.strip().split("+")[0])
    if not m:
        return None
    parts = [int(p) for p in m.group(1).split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def version_cmp(a: str, b: str) -> int | None:
    """-1, 0, 1 like cmp(a, b); None where the two cannot be ordered reliably."""
    try:
        from packaging.version import InvalidVersion, Version

        try:
            va, vb = Version(a), Version(b)
            return (va > vb) - (va < vb)
        except InvalidVersion:
            pass
    except ImportError:
        pass
    if a == b:
        return 0
    ra, rb = _release(a), _release(b)
    if ra is None or rb is None:
        return None
    return (ra > rb) - (ra < rb)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "sha256=" + digest


def mib(n: float) -> str:
    return f"{n / MIB:6.2f} MiB"


def run(cmd: list[str], **kw) -> None:
    print("  $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def die(message: str, code: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


# What .gitignore keeps out of a GPU run's copy of the tree (and out of the wheels).
IGNORED_PARTS = {"__pycache__", "build", "dist", ".pytest_cache", ".ruff_cache", ".hypothesis"}


def _ignored(path: Path) -> bool:
    return path.suffix == ".pyc" or any(
        part in IGNORED_PARTS or part.endswith(".egg-info") for part in path.parts
    )


def source_digest() -> str | None:
    """One hash over the workspace packages' sources, to tell whether the bundle's ferrule-*
    wheels were built from the tree they now sit in."""
    packages = ROOT / "packages"
    if not packages.is_dir():
        return None
    h = hashlib.sha256()
    files = []
    for pkg in sorted(packages.iterdir()):
        files.append(pkg / "pyproject.toml")
        src = pkg / "src"
        if src.is_dir():
            files += [p for p in src.rglob("*") if p.is_file() and not _ignored(p.relative_to(src))]
    for p in sorted(files):
        if p.is_file():
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Wheels: RECORD, trimming, checking


def dist_info_dir(names: list[str]) -> str:
    tops = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    if len(tops) != 1:
        raise ValueError(f"expected one .dist-info folder, found {sorted(tops)}")
    return tops.pop()


def read_record(text: str) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO(text)) if row]


def ray_drop(slim: bool):
    prefixes = RAY_DROP_ALWAYS + (RAY_DROP_SLIM if slim else ())

    def drop(name: str) -> bool:
        return name.startswith(prefixes) or name.endswith(RAY_DROP_SUFFIXES)

    return drop


def trim_wheel(src: Path, dst: Path, drop) -> tuple[int, int]:
    """Rewrite the wheel `src` as `dst` without the entries `drop` selects, RECORD included."""
    part = dst.with_name(dst.name + ".part")
    dropped = kept = 0
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        record_name = dist_info_dir(names) + "/RECORD"
        gone = {n for n in names if drop(n)}
        rows = [r for r in read_record(zin.read(record_name).decode()) if r[0] not in gone]
        with zipfile.ZipFile(part, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
            for info in zin.infolist():
                if info.filename in gone:
                    dropped += 1
                    continue
                data = zin.read(info)
                if info.filename == record_name:
                    buf = io.StringIO()
                    csv.writer(buf, lineterminator="\n").writerows(rows)
                    data = buf.getvalue().encode()
                new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                new.external_attr = info.external_attr  # keeps the executable bits
                new.create_system = info.create_system
                new.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(new, data)
                kept += 1
    os.replace(part, dst)
    return kept, dropped


def verify_wheel(path: Path) -> None:
    """Every entry is in RECORD with its hash and size, and RECORD names nothing missing."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        record_name = dist_info_dir(names) + "/RECORD"
        rows = {r[0]: r for r in read_record(z.read(record_name).decode())}
        problems = []
        for info in z.infolist():
            if info.filename.endswith("/") or info.filename == record_name:
                continue
            row = rows.get(info.filename)
            if row is None:
                problems.append(f"not in RECORD: {info.filename}")
                continue
            if len(row) >= 3 and row[1]:
                data = z.read(info)
                if row[1] != record_hash(data) or (row[2] and int(row[2]) != len(data)):
                    problems.append(f"hash/size differ: {info.filename}")
        present = set(names)
        problems += [f"in RECORD, not in wheel: {n}" for n in rows if n not in present]
    if problems:
        raise ValueError(f"{path.name}: " + "; ".join(problems[:5]))


def ray_wheel_state(path: Path) -> str:
    """'full', 'standard' (trimmed) or 'slim' (trimmed more)."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    if any(n.startswith("ray/jars/") or n.endswith(".js.map") for n in names):
        return "full"
    if any(n.startswith(RAY_DROP_SLIM) for n in names):
        return "standard"
    return "slim"


# ---------------------------------------------------------------------------------------------
# build


def lock_versions() -> dict[str, str]:
    import tomllib

    if not LOCK.is_file():
        die(f"{LOCK} not found: build runs in the repository")
    data = tomllib.loads(LOCK.read_text())
    versions: dict[str, set[str]] = {}
    for pkg in data.get("package", []):
        if "version" in pkg:
            versions.setdefault(normalize(pkg["name"]), set()).add(pkg["version"])
    out = {}
    for name, found in versions.items():
        if len(found) == 1:
            out[name] = found.pop()
        else:  # more than one version locked (forks): take the newest
            best = None
            for v in found:
                if best is None or (version_cmp(v, best) or 0) > 0:
                    best = v
            out[name] = best
    return out


def find_wheel(out: Path, name: str, version: str | None = None) -> list[Path]:
    found = []
    for p in out.glob("*.whl"):
        n, v = wheel_name_version(p)
        if n == name and (version is None or v == version):
            found.append(p)
    return found


def valid_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            dist_info_dir(z.namelist())
        return True
    except (zipfile.BadZipFile, ValueError, OSError):
        return False


def pip_download_args(dest: Path) -> list[str]:
    args = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--python-version",
        TARGET_PY,
        "--implementation",
        "cp",
        "--abi",
        "cp" + TARGET_PY.replace(".", ""),
        "--disable-pip-version-check",
        "-d",
        str(dest),
    ]
    for plat in PLATFORMS:
        args += ["--platform", plat]
    return args


def cmd_build(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    groups = dict(GROUPS)
    for flag, on in ((args.with_, True), (args.without, False)):
        for g in ",".join(flag).split(","):
            g = g.strip()
            if not g:
                continue
            if g not in groups or g == "core":
                die(
                    f"unknown or fixed group {g!r}; optional groups: grpcio, tensorboard, matplotlib"
                )
            groups[g] = on
    chosen = [g for g, on in groups.items() if on]
    print(
        f"bundle {out} for CPython {TARGET_PY} x86-64; groups: {', '.join(chosen)}"
        + (" (slim Ray)" if args.slim_ray else "")
    )

    locked = lock_versions()
    plan: dict[str, tuple[str, str]] = {}  # name -> (version, group)
    for name, group in THIRD_PARTY:
        if not groups[group]:
            continue
        if name not in locked:
            die(f"{name} is not in uv.lock: pin it there (or in THIRD_PARTY) first")
        plan[name] = (locked[name], group)

    # Wheels of other versions, of groups left out, or broken downloads go first.
    known = {normalize(n) for n, _ in THIRD_PARTY}
    for p in sorted(out.glob("*.whl")):
        n, v = wheel_name_version(p)
        if n.startswith(WORKSPACE_PREFIX):
            continue  # rebuilt below
        stale = n in known and (n not in plan or plan[n][0] != v)
        if stale or not valid_zip(p):
            print(f"  removing {p.name} ({'not in this bundle' if stale else 'unreadable'})")
            p.unlink()
    for p in out.glob("*.part"):
        p.unlink()

    # Ray: the trimmed wheel, redone if it is not the wanted cut.
    want_ray = "slim" if args.slim_ray else "standard"
    if "ray" in plan:
        have = find_wheel(out, "ray", plan["ray"][0])
        if have and ray_wheel_state(have[0]) != want_ray:
            print(f"  {have[0].name} is cut as {ray_wheel_state(have[0])}, want {want_ray}: redo")
            have[0].unlink()
            have = []
        if not have:
            with tempfile.TemporaryDirectory(prefix="gpu-bundle-ray-") as tmp:
                print(f"downloading ray=={plan['ray'][0]} (~80 MB, trimmed afterwards)")
                run([*pip_download_args(Path(tmp)), f"ray=={plan['ray'][0]}"])
                (full,) = Path(tmp).glob("ray-*.whl")
                t = time.time()
                kept, dropped = trim_wheel(full, out / full.name, ray_drop(args.slim_ray))
                verify_wheel(out / full.name)
                print(
                    f"  trimmed {full.name}: {mib(full.stat().st_size)} -> "
                    f"{mib((out / full.name).stat().st_size)}, {dropped} entries dropped, "
                    f"{kept} kept, RECORD checked ({time.time() - t:.0f} s)"
                )

    # Other binary wheels, in one pip call.
    missing = [
        f"{n}=={v}"
        for n, (v, _) in plan.items()
        if n not in SDIST_ONLY and n != "ray" and not find_wheel(out, n, v)
    ]
    if missing:
        print(f"downloading {len(missing)} wheels")
        run(pip_download_args(out) + missing)

    # Pure-Python wheels that PyPI has only as sdists.
    for n in SDIST_ONLY:
        if n in plan and not find_wheel(out, n, plan[n][0]):
            with tempfile.TemporaryDirectory(prefix="gpu-bundle-sdist-") as tmp:
                print(f"building {n}=={plan[n][0]} from its sdist")
                run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "wheel",
                        "--quiet",
                        "--no-deps",
                        "--no-cache-dir",
                        "--disable-pip-version-check",
                        "-w",
                        tmp,
                        f"{n}=={plan[n][0]}",
                    ]
                )
                built = list(Path(tmp).glob("*.whl"))
                if len(built) != 1 or not built[0].name.endswith("-py3-none-any.whl"):
                    die(f"{n}: expected one pure-Python wheel, got {[b.name for b in built]}")
                shutil.move(str(built[0]), out / built[0].name)

    # The workspace packages, from the sources as they are now.
    uv = shutil.which("uv")
    if uv is None:
        die("uv not found: it builds the workspace wheels (uv build --all-packages)")
    for p in out.glob(WORKSPACE_PREFIX.replace("-", "_") + "*.whl"):
        p.unlink()
    digest = source_digest()
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-ws-") as tmp:
        print("building the workspace wheels")
        run([uv, "build", "--all-packages", "--wheel", "--quiet", "--out-dir", tmp], cwd=ROOT)
        for w in sorted(Path(tmp).glob("*.whl")):
            shutil.move(str(w), out / w.name)
    if digest != source_digest():
        print(
            "warning: packages/ changed while the wheels were being built; build again",
            file=sys.stderr,
        )

    # Check that every planned wheel is there, exactly once, and write the manifest.
    entries = []
    for name, (version, group) in plan.items():
        found = find_wheel(out, name, version)
        if len(found) != 1:
            die(f"{name}=={version}: expected one wheel in {out}, found {[f.name for f in found]}")
        entries.append((found[0], group))
    workspace = sorted(
        p for p in out.glob("*.whl") if wheel_name_version(p)[0].startswith(WORKSPACE_PREFIX)
    )
    if not workspace:
        die("uv build made no ferrule-* wheels")
    entries += [(p, "workspace") for p in workspace]
    extra = set(out.glob("*.whl")) - {p for p, _ in entries}
    for p in sorted(extra):
        print(f"  note: {p.name} is in {out} but not in this bundle's plan; it is installed too")
        entries.append((p, "extra"))

    manifest = {
        "python": TARGET_PY,
        "groups": chosen,
        "ray_cut": want_ray,
        "source_digest": digest,
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wheels": [],
    }
    for p, group in sorted(entries, key=lambda e: e[0].name.lower()):
        n, v = wheel_name_version(p)
        manifest["wheels"].append(
            {
                "file": p.name,
                "name": n,
                "version": v,
                "group": group,
                "size": p.stat().st_size,
                "sha256": sha256_file(p),
            }
        )
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"\n{len(manifest['wheels'])} wheels in {out}:")
    for w in sorted(manifest["wheels"], key=lambda w: -w["size"]):
        print(f"  {mib(w['size'])}  {w['group']:<11} {w['file']}")
    print(
        f"  total {total / MIB:.2f} MiB (limit {LIMIT_MIB:.0f} MiB; a GPU run carries 64 MiB "
        "with the working tree)"
    )
    if total > LIMIT_MIB * MIB:
        biggest = sorted(manifest["wheels"], key=lambda w: -w["size"])[:4]
        print(
            f"\nerror: the bundle is {total / MIB:.2f} MiB, over the {LIMIT_MIB:.0f} MiB a GPU run "
            "can carry.\n  Largest: "
            + ", ".join(f"{w['name']} {w['size'] / MIB:.1f}" for w in biggest)
            + f"\n  Leave out a group ({', '.join('--without ' + g for g in chosen if g != 'core')})"
            + ("" if args.slim_ray else ", or add --slim-ray")
            + "; see this script's docstring.",
            file=sys.stderr,
        )
        return 2
    return 0


# ---------------------------------------------------------------------------------------------
# install


def installed_distributions(path: list[str]) -> dict[str, object]:
    """normalized name -> the importlib.metadata Distribution found first along `path`."""
    from importlib import metadata

    found: dict[str, object] = {}
    for dist in metadata.distributions(path=path):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist)
    return found


def package_rows(record_text: str) -> set[tuple[str, str]]:
    rows = set()
    for r in read_record(record_text):
        path = r[0]
        if len(r) < 2 or not r[1] or ".dist-info/" in path or path.endswith(".pyc"):
            continue
        if path.startswith("../"):  # scripts, installed outside the site folder
            continue
        rows.add((path, r[1]))
    return rows


def same_files(wheel: Path, dist) -> bool:
    """Whether the installed distribution holds exactly the wheel's files (by RECORD)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        wheel_rows = package_rows(z.read(dist_info_dir(names) + "/RECORD").decode())
    try:
        installed = dist.read_text("RECORD") or ""
    except OSError:
        return False
    return package_rows(installed) == wheel_rows


def bundle_wheels(src: Path) -> list[dict]:
    manifest = src / MANIFEST
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        wheels = data["wheels"]
        missing = [w["file"] for w in wheels if not (src / w["file"]).is_file()]
        if missing:
            die(f"{src} lacks {missing} (listed in {MANIFEST}); was it carried whole?")
        digest = data.get("source_digest")
        here = source_digest()
        if digest and here and digest != here:
            print(
                "warning: packages/ here differs from the sources the ferrule-* wheels were "
                "built from: run `python scripts/gpu_bundle.py build` again and carry the "
                "new bundle",
                file=sys.stderr,
            )
        return wheels
    wheels = []
    for p in sorted(src.glob("*.whl")):
        n, v = wheel_name_version(p)
        group = "workspace" if n.startswith(WORKSPACE_PREFIX) else "?"
        wheels.append({"file": p.name, "name": n, "version": v, "group": group})
    return wheels


def plan_install(wheels: list[dict], src: Path, dists: dict, force: bool) -> list[tuple[dict, str]]:
    """[(wheel, why)] for the wheels to install."""
    todo: dict[str, tuple[dict, str]] = {}
    by_name = {w["name"]: w for w in wheels}
    for w in wheels:
        name, version = w["name"], w["version"]
        dist = dists.get(name)
        have = dist.version if dist is not None else None
        if force:
            todo[name] = (w, "--force")
        elif have is None:
            todo[name] = (w, "missing")
        elif name.startswith(WORKSPACE_PREFIX):
            if have != version:
                todo[name] = (w, f"have {have}")
            elif not same_files(src / w["file"], dist):
                todo[name] = (w, "sources changed")
        else:
            order = version_cmp(have, version)
            if order is None or order < 0:
                todo[name] = (w, f"have {have}")
    for leader, followers in LINKED.items():
        if leader not in by_name:
            continue
        for name in followers:
            w, dist = by_name.get(name), dists.get(name)
            if w is None:
                continue
            exact = dist is not None and dist.version == w["version"]
            if leader in todo:  # the bundle's leader needs the bundle's follower
                if not exact and name not in todo:
                    todo[name] = (w, f"goes with {leader}")
            elif dists[leader].version == by_name[leader]["version"]:
                if not exact and name not in todo:  # the same leader: its own follower
                    todo[name] = (w, f"goes with {leader} {by_name[leader]['version']}")
            else:  # a newer leader is installed: keep the follower it came with
                todo.pop(name, None)
    return [todo[w["name"]] for w in wheels if w["name"] in todo]


def remove_from_target(target: Path, dist) -> None:
    """Uninstall a distribution from a --target folder, by its RECORD."""
    base = Path(dist._path).parent if hasattr(dist, "_path") else None  # type: ignore[attr-defined]
    if base is None or base.resolve() != target.resolve():
        return
    info_dir = Path(dist._path)  # type: ignore[attr-defined]
    text = dist.read_text("RECORD") or ""
    tops = set()
    for r in read_record(text):
        p = (target / r[0]).resolve()
        if target.resolve() in p.parents and p.is_file():
            p.unlink()
            rel = p.relative_to(target.resolve()).parts
            if len(rel) > 1:
                tops.add(target / rel[0])
    shutil.rmtree(info_dir, ignore_errors=True)
    for top in tops:  # empty package folders (and their __pycache__) go too
        for d in sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            if d.name == "__pycache__" or not any(d.iterdir()):
                shutil.rmtree(d, ignore_errors=True)
        if top.is_dir() and not any(top.iterdir()):
            top.rmdir()


def merge_tree(src: Path, dst: Path) -> None:
    """Move src's content into dst, file by file (dst's other files stay)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir() and not item.is_symlink():
            if target.is_dir() and not target.is_symlink():
                merge_tree(item, target)
                continue
            if target.exists() or target.is_symlink():
                target.unlink() if not target.is_dir() else shutil.rmtree(target)
        elif target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(item, target)


def unpack_wheel(wheel: Path, site: Path, scripts: Path) -> None:
    """Install a wheel without pip: its files into `site`, .data/scripts into `scripts`."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info_dir = dist_info_dir(names)
        data_dir = info_dir[: -len(".dist-info")] + ".data/"
        for info in z.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            if name.startswith(data_dir):
                kind, _, rest = name[len(data_dir) :].partition("/")
                if kind in ("purelib", "platlib"):
                    dest = site / rest
                elif kind == "scripts":
                    dest = scripts / rest
                else:
                    continue  # headers, data: not needed here
            else:
                dest = site / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = z.read(info)
            if dest.parent == scripts and data.startswith(b"#!python"):
                data = b"#!" + sys.executable.encode() + data[len(b"#!python") :]
            dest.write_bytes(data)
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111 or dest.parent == scripts:
                dest.chmod(dest.stat().st_mode | 0o755)
        (site / info_dir / "INSTALLER").write_text("gpu_bundle\n")
        entry_points = info_dir + "/entry_points.txt"
        if entry_points in names:
            write_console_scripts(z.read(entry_points).decode(), scripts)


def write_console_scripts(text: str, scripts: Path) -> None:
    """What pip makes of [console_scripts]: `ray`, `rlhf-launch`, ..."""
    section = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]").strip()
        elif section == "console_scripts" and "=" in line:
            name, _, ref = (part.strip() for part in line.partition("="))
            module, _, attr = ref.partition(":")
            attr = attr.split("[")[0].strip()
            scripts.mkdir(parents=True, exist_ok=True)
            script = scripts / name
            script.write_text(
                f"#!{sys.executable}\nimport sys\nfrom {module} import {attr.split('.')[0]}\n"
                f"sys.exit({attr}())\n"
            )
            script.chmod(0o755)


def make_executable(site_dirs: list[Path]) -> list[str]:
    fixed = []
    for site in site_dirs:
        for rel in RAY_BINARIES:
            p = site / rel
            if p.is_file() and not os.access(p, os.X_OK):
                p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                fixed.append(str(p))
    return fixed


def externally_managed() -> bool:
    stdlib = sysconfig.get_path("stdlib")
    return (
        bool(stdlib)
        and Path(stdlib, "EXTERNALLY-MANAGED").is_file()
        and sys.prefix == sys.base_prefix
    )


def have_pip() -> bool:
    try:
        import pip  # noqa: F401

        return True
    except ImportError:
        return False


def byte_compile(site: Path) -> None:
    """Write the bytecode of everything in `site`, as a user's `uv sync` does (`[tool.uv]
    compile-bytecode`): pip ran with --no-compile, and where the machine's Python writes no
    bytecode itself, every role's process would otherwise compile DeepSpeed, Ray and grpc from
    source at each start, all at once. Up-to-date files are skipped, so a second run costs
    seconds at most. A file that does not compile (a module for another Python) is left as
    it is: the import, not this step, would report it."""
    began = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", str(site)],
        capture_output=True,
        text=True,
    )
    failed = done.stdout.count("***") if done.returncode else 0
    also = f"; {failed} file(s) did not compile" if failed else ""
    print(f"bytecode of {site}: {time.time() - began:.1f} s{also}")


def byte_compile_interpreter(marker_dir: Path) -> None:
    """Write the bytecode of the running interpreter's own site-packages (torch, transformers,
    triton: the image's), once per machine (a marker file in `marker_dir` remembers it), where
    this Python writes none itself. The GPU machines' image sets PYTHONDONTWRITEBYTECODE=1 and
    ships torch and triton without bytecode, so each role's process compiled ~5,600 modules
    from source at every start: a policy rank's imports took 16 s on an H200 machine, 7.4 s
    with the bytecode (2026-11-28). A user's `uv sync` writes it ([tool.uv] compile-bytecode);
    this makes those machines start as a user's would. ~9 s on 16 cores, a second check as
    long: hence the marker."""
    if not sys.flags.dont_write_bytecode:
        return  # each module's first import writes its bytecode
    sites = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    marker = marker_dir / ".interpreter-bytecode"
    if marker.exists() and marker.read_text().splitlines() == sites:
        return
    for site in sites:
        byte_compile(Path(site))
    marker.write_text("\n".join(sites) + "\n")


def cmd_install(args: argparse.Namespace) -> int:
    t0 = time.time()
    if sys.version_info[:2] != TARGET_PYTHON:
        die(
            f"the bundle holds CPython {TARGET_PY} wheels; this is "
            f"{sys.version.split()[0]} ({sys.executable})"
        )
    src = Path(args.from_).resolve()
    if not src.is_dir():
        die(f"no bundle at {src}: build it with `python scripts/gpu_bundle.py build` and carry it")
    target = Path(args.target).resolve() if args.target else None
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        search = [str(target)] + [p for p in sys.path if Path(p or ".").resolve() != target]
    else:
        search = list(sys.path)
    wheels = bundle_wheels(src)
    dists = installed_distributions(search)
    todo = plan_install(wheels, src, dists, args.force)
    where = str(target) if target else f"{sys.prefix} (this interpreter)"

    if todo:
        use_pip = have_pip() and not args.no_pip
        print(
            f"installing {len(todo)} of {len(wheels)} wheels into {where}"
            f" ({'pip' if use_pip else 'unpacking, no pip'}):"
        )
        for w, why in todo:
            print(f"  {w['name']} {w['version']}  ({why})")
        files = [str(src / w["file"]) for w, _ in todo]
        if target is not None:
            for w, _ in todo:  # uninstall what the target itself holds, file by file
                dist = dists.get(w["name"])
                if dist is not None:
                    remove_from_target(target, dist)
            if use_pip:
                with tempfile.TemporaryDirectory(prefix=".gpu-bundle-", dir=target.parent) as tmp:
                    subprocess.run([*PIP_INSTALL, "--target", tmp, *files], check=True)
                    merge_tree(Path(tmp), target)
            else:
                for f in files:
                    unpack_wheel(Path(f), target, target / "bin")
        else:
            if use_pip:
                cmd = [*PIP_INSTALL, "--no-warn-conflicts", "--force-reinstall"]
                if externally_managed():
                    cmd.append("--break-system-packages")
                subprocess.run(cmd + files, check=True)
            else:
                site = Path(sysconfig.get_paths()["platlib"])
                for w, _ in todo:
                    dist = dists.get(w["name"])
                    if dist is not None:
                        remove_from_target(site, dist)
                for f in files:
                    unpack_wheel(Path(f), site, Path(sysconfig.get_paths()["scripts"]))
    else:
        print(f"all {len(wheels)} wheels already installed in {where}")

    sites = (
        [target]
        if target
        else [Path(p) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]
    )
    ray = installed_distributions(search).get("ray")
    if ray is not None and hasattr(ray, "locate_file"):
        sites.append(Path(str(ray.locate_file(""))))
    for p in make_executable(sites):
        print(f"  chmod +x {p}")
    if target is not None:
        byte_compile(target)
    byte_compile_interpreter(target or Path(sysconfig.get_paths()["purelib"]))
    print(f"done in {time.time() - t0:.1f} s")
    if target is not None:
        on_path = str(target) in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if not on_path:
            print(
                f'now: export PYTHONPATH="{target}${{PYTHONPATH:+:$PYTHONPATH}}" '
                f'PATH="{target / "bin"}:$PATH"'
            )
    return 0


# ---------------------------------------------------------------------------------------------
# check


def cmd_check(args: argparse.Namespace) -> int:
    import importlib

    if args.target:
        target = str(Path(args.target).resolve())
        if target not in sys.path:
            sys.path.insert(0, target)
        if target not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            print(f"note: {target} is not on PYTHONPATH; Ray's workers will not see it")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from importlib import metadata

    def dist_version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    failures = 0

    def try_import(label: str, module: str, dist: str | None, required: bool, then=None) -> None:
        nonlocal failures
        t = time.time()
        try:
            mod = importlib.import_module(module)
            extra = then(mod) if then else ""
        except Exception as e:  # report any import failure
            failures += required
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            print(f"  {'FAIL' if required else 'miss'}  {label:<30} {type(e).__name__}: {first}")
            return
        version = getattr(mod, "__version__", None) or (dist and dist_version(dist)) or "?"
        where = getattr(mod, "__file__", None) or ""
        where = str(Path(where).parent) if where else ""
        print(f"  ok    {label:<30} {version:<14} {time.time() - t:5.1f} s  {where}{extra}")

    print(f"Python {sys.version.split()[0]} at {sys.executable}")
    print("required:")
    try_import(
        "torch",
        "torch",
        "torch",
        True,
        lambda m: f"  (CUDA {m.version.cuda}, {m.cuda.device_count()} GPUs)",
    )
    try_import("pydantic", "pydantic", "pydantic", True)
    try_import("deepspeed", "deepspeed", "deepspeed", True)
    try_import("ray", "ray", "ray", True)
    for pkg in ("weightsync", "grpc_auth", "trainer", "rollout", "rewards", "launcher", "testkit"):
        try_import(f"ferrule_{pkg}", f"ferrule_{pkg}", f"ferrule-{pkg.replace('_', '-')}", True)
    print("what the launcher's roles import:")
    try_import("ferrule_rewards.server (gRPC)", "ferrule_rewards.server", "grpcio", False)
    try_import("ferrule_rollout gRPC stubs", "ferrule_rollout.rollout_pb2_grpc", "grpcio", False)
    try_import("tqdm", "tqdm", "tqdm", False)
    try_import("torch.utils.tensorboard", "torch.utils.tensorboard", "tensorboard", False)

    def agg(m):
        m.use("Agg")
        importlib.import_module("matplotlib.pyplot")
        return ""

    try_import("matplotlib (Agg, pyplot)", "matplotlib", "matplotlib", False, agg)
    print("versions:")
    needs = {
        "grpcio": "1.85.1",
        "protobuf": "7.35.1",
        "pydantic": "2.11",
        "typing-extensions": None,
    }
    for name in (
        "transformers",
        "pydantic",
        "numpy",
        "grpcio",
        "protobuf",
        "typing-extensions",
        "pydantic-core",
        "psutil",
        "ninja",
        "msgpack",
        "packaging",
        "click",
        "pyyaml",
        "requests",
        "filelock",
        "attrs",
        "aiohttp",
        "jsonschema",
        "tensorboard",
        "matplotlib",
        "pillow",
        "tqdm",
        "safetensors",
        "peft",
        "accelerate",
    ):
        v = dist_version(name)
        low = needs.get(name)
        flag = ""
        if v is None:
            flag = "  MISSING"
        elif low and (version_cmp(v, low) or 0) < 0:
            flag = f"  TOO OLD (need >= {low})"
        print(f"  {name:<18} {v or '-'}{flag}")
    if shutil.which("ninja") is None:
        print("  note: no `ninja` on PATH: DeepSpeed cannot JIT-compile its ops (FusedAdam)")

    print("settings:")
    ngpu = 0
    try:
        import torch

        ngpu = torch.cuda.device_count()
    except Exception:
        pass
    wanted = {"TORCH_CUDA_ARCH_LIST": "9.0", "RAY_USAGE_STATS_ENABLED": "0"}
    if ngpu > 1:
        wanted |= {
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        }
    for key, value in wanted.items():
        have = os.environ.get(key)
        print(
            f"  {key}={have if have is not None else '(unset)'}"
            + ("" if have == value else f"   <- set {key}={value}")
        )
    try:
        from importlib.util import find_spec

        spec = find_spec("ray")
        if spec and spec.origin:
            base = Path(spec.origin).parent.parent
            for rel in RAY_BINARIES:
                p = base / rel
                ok = p.is_file() and os.access(p, os.X_OK)
                print(f"  {rel}: {'executable' if ok else 'NOT executable or missing'}")
                failures += not ok
    except Exception:
        pass

    if args.ray_smoke:
        failures += ray_smoke(ngpu)
    print("check: " + ("all required imports work" if not failures else f"{failures} FAILED"))
    return 1 if failures else 0


def ray_smoke(ngpu: int) -> int:
    print("ray smoke test:")
    t = time.time()
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # "local": a new cluster of our own, never one that `ray start` left running.
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=min(ngpu, 1),
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
        )
        print(f"  ray.init: {time.time() - t:.1f} s, {ray.cluster_resources()}")

        @ray.remote
        class Probe:
            def where(self):
                import ferrule_launcher  # from the bundle: PYTHONPATH reached the worker

                return (
                    os.getpid(),
                    os.environ.get("CUDA_VISIBLE_DEVICES"),
                    ferrule_launcher.__version__,
                )

        bundle = {"CPU": 1} | ({"GPU": 1} if ngpu else {})
        pg = placement_group([bundle])
        ray.get(pg.ready(), timeout=60)
        actor = Probe.options(
            num_cpus=1,
            num_gpus=1 if ngpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg),
        ).remote()
        pid, cuda, version = ray.get(actor.where.remote(), timeout=120)
        print(
            f"  actor in placement group: pid {pid}, CUDA_VISIBLE_DEVICES={cuda}, "
            f"ferrule_launcher {version} ({time.time() - t:.1f} s in all)"
        )
        ray.kill(actor)
        remove_placement_group(pg)
        ray.shutdown()
        return 0
    except Exception as e:
        print(f"  FAIL {type(e).__name__}: {e}")
        return 1


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpu_bundle.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (head of scripts/gpu_bundle.py) for details.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download and build the wheels into OUT (here)")
    b.add_argument("--out", default=str(DEFAULT_OUT), help="bundle folder (default .gpu-bundle)")
    b.add_argument(
        "--with",
        dest="with_",
        action="append",
        default=[],
        metavar="GROUP",
        help="add optional groups: tensorboard, matplotlib",
    )
    b.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="GROUP",
        help="leave out default groups: grpcio",
    )
    b.add_argument(
        "--slim-ray",
        action="store_true",
        help="also drop ray/rllib, data, serve, llm and the dashboard web client",
    )
    i = sub.add_parser("install", help="install the bundle's wheels (on the GPU machine)")
    i.add_argument("--from", dest="from_", default=str(DEFAULT_OUT), help="bundle folder")
    i.add_argument("--target", help="install into this folder (then put it on PYTHONPATH)")
    i.add_argument("--force", action="store_true", help="reinstall every wheel")
    i.add_argument("--no-pip", action="store_true", help="unpack the wheels without pip")
    c = sub.add_parser("check", help="import deepspeed, ray and ferrule_*; print versions")
    c.add_argument("--target", help="also look in this folder (as install --target)")
    c.add_argument(
        "--ray-smoke", action="store_true", help="start a local Ray cluster and place an actor"
    )
    args = parser.parse_args(argv)
    return {"build": cmd_build, "install": cmd_install, "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
