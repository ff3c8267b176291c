"""All-reduce time of a decode batch's hidden states across GPUs of one host (NCCL), for the step estimate.

A tensor-parallel decoder layer all-reduces its [B, hidden] bf16 output twice (after attention, after
the MLP). This times one such all-reduce at each batch size, median over repeats inside a CUDA graph
(launch cost excluded, as in a captured decode step) and eagerly, on every GPU the host has.
Usage: NCCL_NVLS_ENABLE=0 python bench/allreduce.py [--hidden 6144]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import event_median_ms  # noqa: E402

BATCHES = (1, 8, 32, 64, 128)


def _rank(rank: int, world: int, hidden: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows = []
    for batch in BATCHES:
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        for _ in range(10):
            dist.all_reduce(x)
        eager = event_median_ms(lambda: dist.all_reduce(x), 50) * 1e3
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dist.all_reduce(x)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(20):
                    dist.all_reduce(x)
        graphed = event_median_ms(graph.replay, 50) * 1e3 / 20
        torch.cuda.synchronize()
        del graph  # a captured NCCL graph left alive at teardown hangs the process group's destruction
        rows.append((batch, batch * hidden * 2 / 1024, eager, graphed))
    if rank == 0:
        print(f"{world} GPUs, bf16 [B, {hidden}] all-reduce (NCCL)")
        print(f"{'B':>4} {'KiB':>8} {'eager us':>9} {'graph us':>9}")
        for batch, kib, eager, graphed in rows:
            print(f"{batch:>4} {kib:8.0f} {eager:9.1f} {graphed:9.1f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=6144)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("needs at least two GPUs")
    mp.spawn(_rank, args=(world, args.hidden, args.port), nprocs=world)


if __name__ == "__main__":
    main()
