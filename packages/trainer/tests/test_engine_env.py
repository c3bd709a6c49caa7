"""A trainer that starts its own group of one leaves os.environ clean for the processes it starts."""

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
