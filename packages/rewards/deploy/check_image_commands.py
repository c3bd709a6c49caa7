"""Run the reward-server Dockerfile's own commands where no container engine can: CI's check
that the image builds and serves.

    python3 packages/rewards/deploy/check_image_commands.py      # from the repository root

Reads the Dockerfile beside this script and, stage by stage, does what `docker build` would:
each stage is a temporary root with a fresh virtual environment for its Python (the image's
python:3.11-slim), COPY copies into that root, and every RUN line runs as written, with the
absolute paths it names moved under the stage's root. `useradd` is skipped (this is no
container: the server runs as the current user; the check asserts the image's USER is not
root). Then the final stage's ENTRYPOINT + CMD start the server as `docker run` would, with a
token in its environment and the exposed port moved to a free loopback one; the HEALTHCHECK
command must say SERVING, `rlhf-rewards score` must score a sample, and SIGTERM (the
STOPSIGNAL) must stop it with status 0. Prints each step; exits non-zero with the reason.
"""

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOCKERFILE = Path(__file__).with_name("Dockerfile")
REPO = Path(__file__).resolve().parents[3]
SKIPPED = ("useradd",)  # needs root and changes the machine; USER is checked instead
# Top-level folders of a Linux system: an absolute path elsewhere (/src, /wheels, /app) is the
# image's own, and moves under the stage's root.
SYSTEM = {"bin", "boot", "dev", "etc", "home", "lib", "lib64", "media", "mnt", "opt", "proc",
          "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var"}  # fmt: skip
SAMPLE = {"response": "<think>2+2</think> The answer is 4", "label": "4"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


class Stage:
    """One FROM ... stage: its root folder, venv, working directory, environment, user."""

    def __init__(self, root: Path, name: str):
        self.root, self.name = root, name
        self.workdir, self.user, self.env = "/", "root", {}
        root.mkdir(parents=True)
        venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        self.bin = venv / "bin"

    def path(self, inside: str) -> Path:
        """Where the image's absolute path `inside` lies here."""
        return self.root / inside.lstrip("/")

    def rewrite(self, command: str) -> str:
        """`command` with the image's own folders moved under this stage's root."""

        def move(match: re.Match) -> str:
            top = match.group(1)
            return match.group(0) if top in SYSTEM else f"{self.root}/{top}"

        return re.sub(r"(?<![\w./-])/([\w.-]+)", move, command)

    def environ(self) -> dict:
        return {**os.environ, **self.env, "PATH": f"{self.bin}:{os.environ['PATH']}",
                "VIRTUAL_ENV": str(self.bin.parent)}  # fmt: skip


def build(work: Path) -> tuple[Stage, dict]:
    """Every stage's COPY and RUN lines; the final stage and its run settings."""
    stages: dict[str, Stage] = {}
    stage, final = None, {}
    for keyword, rest in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            name = rest.split(" AS ")[-1] if " AS " in rest else str(len(stages))
            stage = stages[name] = Stage(work / f"stage-{len(stages)}", name)
            print(f"--> FROM {rest}: {stage.root}")
        elif keyword == "COPY":
            args = rest.split()
            source_stage = None
            if args[0].startswith("--from="):
                source_stage, args = stages[args[0].removeprefix("--from=")], args[1:]
            source, target = args
            origin = source_stage.root / source.lstrip("/") if source_stage else REPO / source
            shutil.copytree(origin, stage.path(target), dirs_exist_ok=True)
            print(f"--> COPY {rest}")
        elif keyword == "RUN":
            if rest.split()[0] in SKIPPED:
                print(f"--> RUN {rest}: skipped (no container here)")
                continue
            command = stage.rewrite(rest)
            print(f"--> RUN {rest}\n    as: {command}", flush=True)
            cwd = stage.path(stage.workdir) if stage.workdir != "/" else stage.root
            subprocess.run(["sh", "-c", command], check=True, cwd=cwd, env=stage.environ())
        elif keyword == "WORKDIR":
            stage.workdir = rest
            stage.path(rest).mkdir(parents=True, exist_ok=True)
        elif keyword == "USER":
            stage.user = rest
        elif keyword == "ENV":
            key, _, value = rest.partition("=") if "=" in rest.split()[0] else rest.partition(" ")
            stage.env[key] = " ".join(shlex.split(value))
        elif keyword in ("ENTRYPOINT", "CMD", "HEALTHCHECK", "EXPOSE", "STOPSIGNAL"):
            final[keyword] = rest
    return stage, final


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(stage: Stage, final: dict) -> None:
    """Start the final stage as `docker run` would, check health and a Score, stop it."""
    for needed in ("ENTRYPOINT", "CMD", "HEALTHCHECK", "EXPOSE", "STOPSIGNAL"):
        assert needed in final, f"the Dockerfile has no {needed}"
    assert stage.user not in ("root", "0"), (
        f"the image runs as {stage.user!r}, not a user of its own"
    )
    exposed, port = final["EXPOSE"].split()[0], free_port()
    address = f"127.0.0.1:{port}"

    def local(text: str) -> str:  # the exposed port, on any host, becomes ours on loopback
        return re.sub(rf"[\w.]+:{exposed}\b", address, text)

    command = [local(part) for part in json.loads(final["ENTRYPOINT"]) + json.loads(final["CMD"])]
    env = {**stage.environ(), "FERRULE_REWARDS_TOKEN": secrets.token_hex(16)}  # --env-file's
    print(f"--> docker run: {shlex.join(command)}", flush=True)
    cwd = stage.path(stage.workdir)
    server = subprocess.Popen(command, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            sys.stderr.write(line)
            if " serving " in line:
                break
        else:
            raise SystemExit(f"the server exited with status {server.wait()} before serving")
        health = local(final["HEALTHCHECK"].split(" CMD ", 1)[1])
        print(f"--> HEALTHCHECK: {health}", flush=True)
        done = subprocess.run(["sh", "-c", health], env=env, capture_output=True, text=True)
        assert done.returncode == 0 and "SERVING" in done.stdout, (done.stdout, done.stderr)
        print(f"    {done.stdout.strip()}")
        score = [str(stage.bin / "rlhf-rewards"), "score", address]
        done = subprocess.run(
            score, input=json.dumps(SAMPLE), env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["status"] == "ok" and result["reward"] > 0, result
        print(f"--> Score: {result}")
        server.send_signal(getattr(signal, final["STOPSIGNAL"]))
        status = server.wait(30)
        assert status == 0, f"the server exited with status {status} after SIGTERM"
        print(f"--> stopped by {final['STOPSIGNAL']}: status 0")
    finally:
        if server.poll() is None:
            server.kill()


def main() -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ferrule-image-") as work:
        stage, final = build(Path(work))
        serve(stage, final)
    print(f"the image's commands built and served in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
