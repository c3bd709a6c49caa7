"""A weight-sync peer in its own process, driven by the tests: `python peer.py --role receiver ...`,
or `main_logged_to(log, argv)` in a process forked from a server that imported torch already.

Receivers save what they received (or the error they raised) with torch.save to --out. Options
inject the failures the tests need: corrupt a bucket, stall inside a bucket (to be killed), stop
consuming early; a sender can stall after its first bucket.
"""

import argparse
import os
import time
import traceback

import torch

from ferrule_weightsync import TensorSpec, WeightSyncError, create_receiver, create_sender


def realistic_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd shapes, 0-dim, empty and non-contiguous tensors, and one large tensor."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g)
    return {
        "embed.weight": torch.randn(97, 32, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv.weight": torch.randn(96, 32, generator=g),
        "layers.0.attn.qkv.bias": torch.randn(96, generator=g).half(),
        "layers.0.mlp.up.weight.T": base.t(),  # non-contiguous: transposed
        "layers.0.mlp.strided": base[::2, 1::3],  # non-contiguous: strided slices
        "layers.0.norm.eps": torch.tensor(1e-6, dtype=torch.float64),  # 0-dim
        "layers.0.empty": torch.empty(0, 5),
        "layers.0.odd": torch.randn(7, 13, 3, generator=g),
        "layers.0.mask": torch.rand(11, generator=g) > 0.5,
        "step": torch.tensor(12345, dtype=torch.int64),
        "lm_head.weight": torch.randn(512, 300, generator=g).to(torch.bfloat16),  # > small buckets
    }


def trainer_weights(device: str = "cuda:0") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A trainer's weights as an in-place sender hands them over: views into one flat bf16
    buffer (the flat buffer returned too) and two tensors of their own."""
    flat = torch.randn(10_000, device=device).bfloat16()
    return flat, {
        "layers.0.weight": flat[:1200].view(40, 30),
        "layers.0.bias": flat[1200:1204],
        "layers.1.weight": flat[1204:5204].view(100, 40),
        "norm.weight": torch.randn(17, device=device),
        "step": torch.arange(7, device=device),
    }


def engine_weights(specs: dict[str, torch.Tensor], device: str = "cuda:0") -> dict:
    """An engine's weights for `specs` (name -> a tensor of the shape and dtype), zeroed, in
    one allocation, each 16-byte aligned, and one more tensor no update names."""
    sizes = [-(-t.numel() * t.element_size() // 16) * 16 for t in specs.values()]
    flat = torch.zeros(sum(sizes) + 64, dtype=torch.uint8, device=device)
    weights, offset = {}, 0
    for (name, like), size in zip(specs.items(), sizes, strict=True):
        nbytes = like.numel() * like.element_size()
        weights[name] = flat[offset : offset + nbytes].view(like.dtype).view(like.shape)
        offset += size
    weights["rotary.inv_freq"] = flat[offset:].view(torch.float32)
    return weights


def scaled(state: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: (v * factor).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}


def run_receiver(args) -> None:
    results = []
    try:
        receiver = create_receiver(
            args.transport,
            "127.0.0.1",
            args.port,
            args.rank,
            args.num_receivers,
            timeout=args.timeout,
            secret=args.secret,
            **({"device": args.device} if args.transport == "broadcast" else {}),
        )
        expected = realistic_state_dict() if args.expect else None
        if expected is not None and args.expect == "float32":
            expected = {k: v.float() if v.is_floating_point() else v for k, v in expected.items()}
        if expected is not None and args.expect == "wrong-shape":
            expected["layers.0.odd"] = torch.zeros(7, 13)
        if args.receive_into:
            _, like = trainer_weights()
            targets = engine_weights(like)
        for number in range(1, args.updates + 1):
            if args.receive_into:  # an engine's load into its own weights
                loaded = []
                try:
                    result = {"version": receiver.receive_into(targets, loaded)}
                except WeightSyncError as err:  # what a caller that goes on knows of the update
                    results.append({"error": f"{type(err).__name__}: {err}", "loaded": loaded})
                    continue
                torch.cuda.synchronize()
                result["state"] = {name: targets[name].cpu() for name in loaded}
                results.append(result)
                continue
            if number == args.refuse_update:  # expectations that changed since the last update
                wrong = dict(expected or realistic_state_dict(), **{"layers.0.odd": torch.zeros(7)})
                try:
                    receiver.receive(expected=wrong)
                except Exception as err:
                    results.append({"error": f"{type(err).__name__}: {err}"})
                continue
            update = receiver.receive(expected=expected, cast=_cast(args.cast))
            received = {}
            if args.gpu_load_after_ms:  # an engine's load on the GPU, queued behind other work
                targets = {s.name: torch.zeros(s.shape, dtype=s.dtype, device="cuda")
                           for s in update.specs}  # fmt: skip
                if number > 1:  # (the first maps the sender's memory, which waits for the GPU)
                    torch.cuda._sleep(int(args.gpu_load_after_ms * 2e6))  # ~2 GHz: cycles a ms
                update.load_into(targets)  # reports done before the copies have run
                torch.cuda.synchronize()
                received = {name: t.cpu() for name, t in targets.items()}
            elif args.load_into:  # an engine's load: into its own tensors, bucket by bucket
                received = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in update_targets(
                    expected or realistic_state_dict(), args.load_into).items()}  # fmt: skip
                update.load_into(received)
            loaded = args.load_into or args.gpu_load_after_ms
            for i, (name, tensor) in enumerate(() if loaded else update):
                if args.stall_at is not None and i == args.stall_at:
                    time.sleep(3600)  # the test kills us here, mid-transfer
                if args.stop_after is not None and i == args.stop_after:
                    break
                received[name] = tensor.to("cpu", copy=True)
            results.append(
                {
                    "version": update.version,
                    "handshake": update.manifest.handshake,
                    "state": received,
                    "handles_opened": getattr(receiver, "handles_opened", None),
                }
            )
        receiver.close()
    except Exception as err:
        results.append({"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})
    torch.save(results, args.out)


def update_targets(state: dict, how: str) -> dict:
    """--load-into: "all" the tensors of `state`, or "missing" all but one."""
    return {k: v for k, v in state.items() if how == "all" or k != "layers.0.odd"}


def _cast(value):
    return {"": False, "true": True, "float16": torch.float16}[value or ""]


def run_sender(args) -> None:
    sender = create_sender(
        args.transport,
        "127.0.0.1",
        args.port,
        args.num_receivers,
        bucket_bytes=args.bucket_bytes,
        timeout=args.timeout,
        secret=args.secret,
    )
    state = realistic_state_dict()
    specs = [TensorSpec.of(name, t) for name, t in state.items()]

    def stalling_stream():
        for i, item in enumerate(state.items()):
            if i == args.stall_at:
                time.sleep(3600)  # killed here, after the first buckets went out
            yield item

    sender.send(stalling_stream(), specs=specs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["sender", "receiver"], default="receiver")
    parser.add_argument("--transport", default="broadcast")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--num-receivers", type=int, default=1)
    parser.add_argument("--updates", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--bucket-bytes", type=int, default=4096)
    parser.add_argument("--expect", default="")
    parser.add_argument("--cast", default="")
    parser.add_argument("--stall-at", type=int)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--load-into", choices=["all", "missing"], help="Update.load_into")
    parser.add_argument(
        "--gpu-load-after-ms", type=float, help="load_into on the GPU, late from update 2 on"
    )
    parser.add_argument("--receive-into", help="receive_into an engine's weights on cuda:0")
    parser.add_argument("--refuse-update", type=int, help="refuse update N (1-based), go on")
    parser.add_argument("--device", default="cpu", help="broadcast receivers: cpu or cuda:N")
    parser.add_argument("--secret", help="the group's shared secret")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    run_sender(args) if args.role == "sender" else run_receiver(args)


def main_logged_to(log: str, argv: list[str]) -> None:
    """`main(argv)` with this process's output in the file `log`, as a pipe would hold it."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    main(argv)


if __name__ == "__main__":
    main()
