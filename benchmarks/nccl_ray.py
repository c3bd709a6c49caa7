"""NCCL between the launcher's Ray actors against NCCL between processes that see every GPU.

    python benchmarks/nccl_ray.py [--gpus 4]

Ray gives each actor of `num_gpus=1` one visible GPU (CUDA_VISIBLE_DEVICES), as the launcher's
policy ranks get; NCCL must then find its peers without seeing them. The work is what ZeRO-2
does after each micro-batch's backward at 1.5B: a reduce-scatter of the whole bf16 gradient
(1.54e9 elements, 3.1 GB) over --gpus ranks, and an all-reduce of a quarter of it.
  ours     = the ranks as Ray actors (one GPU visible each);
  baseline = the ranks as processes spawned with every GPU visible, each on its own device.
Each figure is the median over --repeats collectives after one warm-up, on the slowest rank.
ratio = ours / baseline reduce-scatter throughput (1.0: Ray's actors lose nothing). The last line
printed is one JSON object.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

ELEMENTS = 1_543_714_304  # a Qwen2.5-1.5B-shaped model's parameters


def collectives(rank: int, world: int, port: int, repeats: int) -> dict:
    """Time this rank's share of the collectives; every rank must call it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    gradient = torch.ones(ELEMENTS // world * world, dtype=torch.bfloat16, device="cuda")
    shard = torch.empty(ELEMENTS // world, dtype=torch.bfloat16, device="cuda")

    def timed(collective) -> float:
        seconds = []
        for _ in range(repeats + 1):  # the first sets up NCCL's channels
            torch.cuda.synchronize()
            dist.barrier()
            began = time.perf_counter()
            collective()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
        return statistics.median(seconds[1:])

    reduce_scatter = timed(lambda: dist.reduce_scatter_tensor(shard, gradient))
    all_reduce = timed(lambda: dist.all_reduce(gradient[: ELEMENTS // 4]))
    dist.destroy_process_group()
    return dict(reduce_scatter_s=reduce_scatter, all_reduce_quarter_s=all_reduce)


def _spawned(rank: int, world: int, port: int, repeats: int, results) -> None:
    torch.cuda.set_device(rank)
    results.put(collectives(rank, world, port, repeats))


def baseline(world: int, repeats: int) -> list[dict]:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=_spawned, args=(rank, world, 29611, repeats, results))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    timings = [results.get(timeout=300) for _ in ranks]
    for process in ranks:
        process.join()
    return timings


def ours(world: int, repeats: int) -> list[dict]:
    import ray

    ray.init(num_gpus=world, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_gpus=1)
    class Rank:
        def run(self, rank: int) -> dict:
            assert len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) == 1  # as the launcher's
            return collectives(rank, world, 29612, repeats)

    ranks = [Rank.remote() for _ in range(world)]
    try:
        return ray.get([r.run.remote(rank) for rank, r in enumerate(ranks)], timeout=300)
    finally:
        ray.shutdown()


def slowest(timings: list[dict]) -> dict:
    figures = {key: max(t[key] for t in timings) for key in timings[0]}
    figures["reduce_scatter_gb_s"] = 2 * ELEMENTS / figures["reduce_scatter_s"] / 1e9
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    have = torch.cuda.device_count()
    if not 2 <= args.gpus <= have:
        parser.error(
            f"--gpus {args.gpus}: needs 2 or more CUDA GPUs, at most this machine's {have}"
        )
    theirs = slowest(baseline(args.gpus, args.repeats))
    mine = slowest(ours(args.gpus, args.repeats))
    result = dict(
        name="nccl_ray",
        device=torch.cuda.get_device_name(0),
        gpus=args.gpus,
        ours=mine,
        baseline=theirs,
        ratio=mine["reduce_scatter_gb_s"] / theirs["reduce_scatter_gb_s"],
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
