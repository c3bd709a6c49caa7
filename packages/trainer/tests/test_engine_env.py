"""Starting the trainer's process group: what it leaves in os.environ, what it must not wait on."""

import json
import os
import subprocess
import sys


def test_group_of_one_does_not_leak_rank_or_master_port():
    code = (
        "import json, os; from ferrule_trainer import engine; engine.init_distributed(); "
        "import torch.distributed as d; "
        "print(json.dumps([d.get_world_size(), "
        "[k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT') if k in os.environ]]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    world_size, leaked = json.loads(out.stdout.strip().splitlines()[-1])
    assert world_size == 1
    assert leaked == []  # a launcher started from here would otherwise join this private group


def test_cpu_group_needs_no_compiled_op(tmp_path):
    # A build killed mid-way leaves torch's lock file behind; DeepSpeed's CPU backend would wait
    # on it forever before building its shared-memory op. The trainer must not build it at all.
    stale = tmp_path / "deepspeed_shm_comm"  # TORCH_EXTENSIONS_DIR/<op name>
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    code = (
        "from ferrule_trainer import engine; engine.init_distributed(); "
        "import torch.distributed as d; print(d.get_backend())"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), DS_ACCELERATOR="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "gloo"
    assert not (stale / "deepspeed_shm_comm.so").exists()
