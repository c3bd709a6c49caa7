"""The trainer's end of ferrule-weightsync: train a small model a few steps, send its weights
after each, then close (which ends the receivers' loops).

    python examples/weightsync/sender.py --receivers 2 &           # gloo broadcast on CPU
    python examples/weightsync/receiver.py --rank 1 --receivers 2 &
    python examples/weightsync/receiver.py --rank 2 --receivers 2

`--transport ipc` for shared memory (processes on one host); `--device cuda` for NCCL (one GPU
per rank: the sender on cuda:0, receiver r on cuda:r) or CUDA IPC (every rank on cuda:0).
Each side prints the digest of the weights of every version: they match when a sync landed.
A sender that exits without `close()` (an exception, SIGTERM) still ends the receivers' loops:
ferrule_weightsync closes it at exit.
"""

import argparse
import sys

import torch

from ferrule_weightsync import WeightSyncError, create_sender, digest


def make_model(seed: int, device: str) -> torch.nn.Module:
    """The same architecture on both sides; the seed makes the receiver's start different."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    return model.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=["broadcast", "ipc"], default="broadcast")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--host", default="127.0.0.1", help="where receivers reach the sender")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    device = "cuda:0" if args.device == "cuda" else "cpu"
    model = make_model(seed=0, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Waits (up to connect_timeout, logging whom it waits for) until every receiver has joined;
    # a receiver started with another --receivers makes it fail at once, saying so.
    try:
        sender = create_sender(args.transport, args.host, args.port, args.receivers, device=device)
    except WeightSyncError as err:
        sys.exit(str(err))  # one line on stderr, exit status 1
    try:
        for step in range(args.steps):
            inputs = torch.randn(32, 64, device=device)
            loss = model(inputs).pow(2).mean()  # a stand-in for a real loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # Returns once every receiver has loaded it; the version counts up from 1.
            version = sender.send(model.named_parameters())
            print(f"sent version {version} (step {step}): {digest(model.named_parameters())}")
    finally:
        sender.close()  # receivers' receive() returns None: their loops end
    print("closed")


if __name__ == "__main__":
    main()
