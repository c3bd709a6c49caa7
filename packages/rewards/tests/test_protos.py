"""The generated protobuf code is current, and scripts/gen_protos.py catches it when it is not."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gen_protos.py"


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )


def test_generated_code_is_up_to_date():
    done = run(SCRIPT, "--check", str(ROOT / "proto/ferrule/rewards"))  # ours; CI checks all
    assert done.returncode == 0, done.stdout + done.stderr


def test_stale_code_fails_the_check_until_regenerated(tmp_path):
    """In a copy of the layout: edit the proto, --check fails naming the file; regenerate,
    --check passes; the new field is there."""
    package = Path("packages/rewards/src/ferrule_rewards")
    shutil.copytree(ROOT / "proto/ferrule/rewards", tmp_path / "proto/ferrule/rewards")
    shutil.copytree(ROOT / package, tmp_path / package)
    (tmp_path / "scripts").mkdir()
    script = shutil.copy(SCRIPT, tmp_path / "scripts")
    proto = tmp_path / "proto/ferrule/rewards/v1/rewards.proto"
    proto.write_text(
        proto.read_text().replace("string label = 5;", "string label = 5;\n  int32 extra = 99;")
    )

    stale = run(script, "--check")
    assert stale.returncode == 1
    assert "packages/rewards/src/ferrule_rewards/rewards_pb2.py" in stale.stderr
    assert "run `uv run python scripts/gen_protos.py`" in stale.stderr
    assert run(script).returncode == 0
    assert run(script, "--check").returncode == 0
    assert "extra: int" in (tmp_path / package / "rewards_pb2.pyi").read_text()


def test_the_grpc_stubs_import_from_our_package():
    from ferrule_rewards import rewards_pb2_grpc

    source = Path(rewards_pb2_grpc.__file__).read_text()
    assert "from ferrule_rewards import rewards_pb2" in source
    assert "from ferrule.rewards" not in source
    assert rewards_pb2_grpc.RewardServiceStub
