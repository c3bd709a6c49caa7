"""Start a torch.distributed group of worker processes on CPU, the way the trainer's
multi-process tests do:

    run_ranks([sys.executable, "worker.py", model_path, out_dir], world=2)
"""

import os
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], world: int, timeout: float = 300) -> None:
    """Run `args` as ranks 0..world-1 of one group (gloo, DeepSpeed's CPU accelerator, one
    thread each) and wait for them. If a rank fails, the assertion error shows the end of its
    output."""
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            args,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, output[-4000:]
    finally:  # a rank that failed or hung leaves the others waiting on it
        for proc in procs:
            proc.kill()
