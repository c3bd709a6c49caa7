"""An inference engine's end of ferrule-weightsync: load every update the sender sends into a
model of the same architecture, until the sender closes. See sender.py for how to run both.

    python examples/weightsync/receiver.py --rank 1 --receivers 1 [--transport ipc] [--device cuda]

A sender that exits, closed or not, ends the stream; one killed outright (kill -9), or a group
set up wrong (another --receivers than the sender's), ends this receiver with one line saying so.
"""

import argparse
import os
import sys

# torch's store logs a C++ warning, with a C++ stack, when the sender's connection drops (and
# when a wait times out); ferrule_weightsync's own error says what happened. Set it before torch
# loads (TORCH_CPP_LOG_LEVEL=WARNING in the environment shows them again).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch
from sender import make_model

from ferrule_weightsync import WeightSyncError, create_receiver, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=["broadcast", "ipc"], default="broadcast")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--host", default="127.0.0.1", help="the sender's host")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--rank", type=int, default=1, help="1 to --receivers, one per receiver")
    parser.add_argument("--receivers", type=int, default=1)
    args = parser.parse_args()

    # NCCL needs a GPU of its own per rank; CUDA IPC maps the sender's buffers on its GPU.
    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{args.rank % torch.cuda.device_count()}"
        if args.transport == "ipc":
            device = "cuda:0"
    model = make_model(seed=args.rank, device=device)  # different weights until the first sync
    weights = dict(model.named_parameters())
    options = {"device": device} if args.transport == "broadcast" else {}
    try:
        receiver = create_receiver(
            args.transport, args.host, args.port, args.rank, args.receivers, **options
        )
        try:
            # Names, shapes and dtypes are checked against `weights` before any data moves;
            # the loop ends when the sender closes or exits (receive returns None).
            while (update := receiver.receive(expected=weights)) is not None:
                update.load_into(weights)  # bucket by bucket, as each lands
                if device != "cpu":
                    torch.cuda.synchronize(device)  # the copies are queued on the current stream
                print(
                    f"rank {args.rank} loaded version {update.version}: {digest(weights.items())}"
                )
        finally:
            receiver.close()
    except WeightSyncError as err:  # the sender was killed, or the group was set up wrong
        sys.exit(str(err))  # one line on stderr, exit status 1
    print(f"rank {args.rank}: the sender closed the stream")


if __name__ == "__main__":
    main()
