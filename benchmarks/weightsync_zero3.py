"""A ZeRO-3 policy's weight update, end to end: gathered by ferrule-trainer's export, sent by
ferrule-weightsync, loaded by a receiver, against a raw broadcast of the same bytes.

    python benchmarks/weightsync_zero3.py nccl      # 2 GPUs: ranks on cuda:0 / cuda:1, receiver on cuda:1
    python benchmarks/weightsync_zero3.py nccl --receiver-gpu 2    # 3 GPUs: the receiver on its own
    python benchmarks/weightsync_zero3.py ipc       # 1 GPU: a ZeRO-3 policy of one rank, receiver beside it,
                                                    # packed and in place
    python benchmarks/weightsync_zero3.py nccl --device cpu --layers 2 --hidden 64   # plumbing, gloo

The policy is ferrule-trainer's `Actor` (DeepSpeed ZeRO-3, bf16) on ferrule-testkit's Qwen2 of
the given shape (default ~0.6B parameters). One update, as the launcher runs it under a
broadcast: rank 0 hands `Actor.export_weights(bucket_bytes=...)` to a sender of the same
bucket size (one sender and receiver per size: the export gathers each bucket into a buffer in
the sender's layout, sent without packing), the other ranks join its all-gathers and keep
nothing (`Actor.take_part_in_export`), and the receiver loads every tensor into its own copy
of the model with `receive_into`, the load of ferrule-rollout's transformers engine, into
weights laid out as that engine lays out its parameters (one allocation per dtype, in the
model's order: copies that continue each other on both sides merge into one). Under ipc the
policy of one rank also sends in place, as the launcher does (`send(..., in_place=True)`):
the receiver reads the policy's own memory into weights in the engine's layout, timed as
`ours_in_place`, and into weights each allocated on its own (`ours_in_place_separate`: one
copy per tensor). Timed on rank 0 from the start of the export until the sender's `send`
returns, which is after every receiver reported its load done and its reads ended. Each export
bucket size given is timed in the same rounds, beside `gather_only` (every rank iterates the
export, each gathering the whole model, nothing sent) and the baseline: one raw broadcast of a
flat buffer of the same bytes in the sender's own group (nccl), or one device-to-device copy of
them (ipc). Rounds alternate between all of them; the first warms up; medians are reported. Before each
timed update the policy spins for `--settle-ms` (3), so that the receiver, which serves every
way in turn, waits for the update as an engine does instead of finishing its previous load.

Before any timing, every exported tensor is checked against DeepSpeed's own gather of that
parameter, and after the last round the receiver's model against the export (digests): bit
for bit, the run stops otherwise. ratio = baseline / ours at the best way of sending (goal
>= 0.6). Last line: one JSON object.
"""

import argparse
import json
import os
import queue
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

MB = 2**20
IN_PLACE = ("in_place", "in_place_separate")  # into the engine's layout, into separate tensors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settle(ms: float) -> None:
    """Let the receiver reach its next receive, as an engine waits in its update call while the
    trainer steps: spinning, as a busy trainer's CPU would be (a sleep lets the core slow down,
    and the next update's Python with it)."""
    until = time.perf_counter() + ms / 1e3
    while time.perf_counter() < until:
        pass


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def policy_worker(rank: int, world: int, ports: dict, args, out) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(ports["policy"]),
    )
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    from ferrule_trainer.actor import Actor
    from ferrule_weightsync import create_sender

    actor = Actor(args.model, zero_stage=3, dtype=args.dtype, learning_rate=1e-5)
    device = actor.device
    specs = actor.weight_specs()
    nbytes = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in specs)
    senders = {}
    if rank == 0:
        transport = "broadcast" if args.mode == "nccl" else "ipc"
        for way, port in zip(args.ways, ports["sync"], strict=True):
            bucket_mb = args.ways[way]  # None: in place, no buckets
            senders[way] = create_sender(
                transport, "127.0.0.1", port, 1, device=device,
                **({"bucket_bytes": bucket_mb * MB} if bucket_mb else {}),
            )  # fmt: skip
        sender = senders[f"{args.bucket_mb[0]}mb"]
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        copy = torch.empty_like(flat) if args.mode == "ipc" else None

    # First, that it is right: the export equals DeepSpeed's own gather of each parameter, bit
    # for bit, at the smallest bucket size asked for (every rank takes part in both gathers).
    import deepspeed

    smallest = min(args.bucket_mb) * MB
    exported = {name: t.clone() for name, t in actor.export_weights(bucket_bytes=smallest)}
    for name, param in actor.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if not torch.equal(exported.pop(name), param.detach()):
                raise SystemExit(f"the export of {name} differs from DeepSpeed's gather")
    del exported

    def ours(bucket_mb: int) -> None:
        # as the launcher under a broadcast: rank 0 sends, the others only join the gathers
        if rank:
            actor.take_part_in_export(bucket_bytes=bucket_mb * MB)
        else:
            weights = actor.export_weights(bucket_bytes=bucket_mb * MB)
            senders[f"{bucket_mb}mb"].send(weights, specs=specs)

    def ours_in_place(way: str) -> None:  # as the launcher sends an export of its own memory
        assert actor.export_in_place()
        senders[way].send(actor.export_weights(), specs=specs, in_place=True)

    def gather_only(bucket_mb: int) -> None:
        for _ in actor.export_weights(bucket_bytes=bucket_mb * MB):
            pass

    def baseline() -> None:
        if rank != 0:
            return
        if args.mode == "ipc":
            copy.copy_(flat)
        else:
            sender._group.broadcast(flat).wait()

    # gather_only first: the receiver has no broadcast posted then (after `ours` it posts the
    # baseline's), whose waiting kernel would share GPU 1 with rank 1's gathers
    work = [(f"gather_only_{mb}mb", gather_only, mb) for mb in args.bucket_mb]
    work += [(f"ours_{mb}mb", ours, mb) for mb in args.bucket_mb]
    if args.mode == "ipc":
        work += [(f"ours_{way}", ours_in_place, way) for way in IN_PLACE]
    times: dict[str, list[float]] = {name: [] for name, *_ in work}
    times["baseline"] = []
    for round_ in range(args.repeats + 1):
        for name, fn, *options in [*work, ("baseline", baseline)]:
            settle(args.settle_ms)
            torch.distributed.barrier()
            synchronize(device)
            started = time.perf_counter()
            fn(*options)
            synchronize(device)
            if round_:
                times[name].append(time.perf_counter() - started)
    if rank:
        actor.take_part_in_export()  # rank 0's export below: what the receiver must hold
    else:
        from ferrule_weightsync import digest

        sent = digest(actor.export_weights())
        out.put(
            {
                "bytes": nbytes,
                "tensors": len(specs),
                "times": times,
                "sent_digest": sent,
            }
        )
        for sender in senders.values():
            sender.close()
    torch.distributed.barrier()


def receiver_worker(ports: dict, args, out) -> None:
    from ferrule_weightsync import create_receiver

    device = torch.device("cuda", args.receiver_gpu if args.mode == "nccl" else 0)
    if args.device == "cpu":
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(device)
    if args.mode == "nccl":
        receivers = [
            create_receiver("broadcast", "127.0.0.1", port, 1, 1, device=device)
            for port in ports["sync"]
        ]
    else:
        receivers = [create_receiver("ipc", "127.0.0.1", port, 1, 1) for port in ports["sync"]]
    models: dict[str, dict[str, torch.Tensor]] = {}  # the engine's weights, by layout
    flat = None
    for _ in range(args.repeats + 1):
        for way, receiver in zip(args.ways, receivers, strict=True):
            layout = "separate" if way == "in_place_separate" else "engine"
            if layout in models:  # the engine's load (ipc: the sender may write into them)
                receiver.receive_into(models[layout])
            else:  # the first: the update's specs say what to allocate
                update = receiver.receive()
                models[layout] = allocate(update.specs, device, layout)
                update.load_into(models[layout])
            synchronize(device)
        if args.mode == "nccl":
            if flat is None:
                nbytes = sum(t.numel() * t.element_size() for t in models["engine"].values())
                flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            receivers[0]._group.broadcast(flat).wait()
            synchronize(device)
    from ferrule_weightsync import digest

    digests = {layout: digest(model.items()) for layout, model in models.items()}
    out.put({"received_tensors": len(models["engine"]), "received_digests": digests})
    for receiver in receivers:
        receiver.close()


def allocate(specs, device: torch.device, layout: str) -> dict[str, torch.Tensor]:
    """The engine's weights: laid out as ferrule-rollout's transformers engine lays out its
    parameters (one allocation per dtype, in the model's order), or each in an allocation of
    its own (as an engine that allocates layer by layer)."""
    if layout == "separate":
        return {s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs}
    from ferrule_rollout.hf_engine import lay_out

    placed = lay_out([(s.shape, s.dtype) for s in specs], device)
    return dict(zip((s.name for s in specs), placed, strict=True))


def wait_for_results(out, procs, count: int, timeout: float) -> dict:
    """`count` result dicts from the workers; stops at once, killing the rest, if a worker
    dies first (the others would wait for it until the timeout)."""
    results, deadline = {}, time.monotonic() + timeout
    while count:
        try:
            results |= out.get(timeout=2)
            count -= 1
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"a worker exited with status {failed[0]}" if failed else "timed out"
                raise SystemExit(f"weightsync_zero3: {why} (see above)") from None
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["nccl", "ipc"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bucket-mb", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument(
        "--settle-ms", type=float, default=3.0, help="before each timed update (0: back to back)"
    )
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument(
        "--receiver-gpu",
        type=int,
        default=1,
        help="nccl: the receiver's GPU; 1 shares rank 1's (a two-GPU host), 2 is one of its own",
    )
    args = parser.parse_args()
    if args.bucket_mb is None:
        args.bucket_mb = [512, 128, 32]
    args.ways = {f"{mb}mb": mb for mb in args.bucket_mb}  # way of sending -> bucket MB
    if args.mode == "ipc":
        args.ways |= dict.fromkeys(IN_PLACE)  # no buckets
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if args.mode == "ipc":
            raise SystemExit("ipc needs a GPU")
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    from ferrule_testkit import tiny_model

    heads = max(args.hidden // 128, 1)
    args.model = str(
        tiny_model(
            "qwen2",
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=max(heads // 4, 1),
        )
    )
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = {"policy": free_port(), "sync": [free_port() for _ in args.ways]}
    world = 2 if args.mode == "nccl" else 1
    procs = [
        ctx.Process(target=policy_worker, args=(r, world, ports, args, out)) for r in range(world)
    ]
    procs.append(ctx.Process(target=receiver_worker, args=(ports, args, out)))
    for p in procs:
        p.start()
    results = wait_for_results(out, procs, count=2, timeout=560)
    for p in procs:
        p.join(60)
    for layout, received in results["received_digests"].items():
        if received != results["sent_digest"]:
            raise SystemExit(f"weightsync_zero3: the receiver's {layout} weights differ")
    median = {key: statistics.median(times) for key, times in results["times"].items()}
    best = min((key for key in median if key.startswith("ours_")), key=median.get)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    line = {
        "name": f"weightsync_zero3_{args.mode}",
        "device": f"{world} x {device}",
        "receiver_gpu": args.receiver_gpu if args.mode == "nccl" else 0,
        "settle_ms": args.settle_ms,
        "gb": round(results["bytes"] / 1e9, 3),
        "tensors": results["tensors"],
        "ms": {key: round(value * 1e3, 2) for key, value in median.items()},
        "best": best,
        "ratio": round(median["baseline"] / median[best], 3),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
