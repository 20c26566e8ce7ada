"""Bucketed all-reduce of a GPT's gradients versus one all_reduce per tensor.

    python bench/comm.py                       # CPU, gloo, 2 processes
    python bench/comm.py --device cuda         # one process per GPU, nccl

Prints per-step time of each way and the ratio (per-tensor / bucketed; > 1 means buckets win).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipezero.comm import all_reduce, all_reduce_coalesced
from launch import finish_rank, init_rank  # bench/launch.py (bench/ is on sys.path when run as a script)


def gpt_grad_shapes(layers: int, d: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT block stack (weights, biases, layer norms) plus embedding."""
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (2048, d)] + block * layers + [(d,), (d,)]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, args) -> None:
    device = init_rank(rank, world, port, args.device)
    rows = []
    for name, (layers, d, vocab) in {"GPT 12x768 (~110M)": (12, 768, 32000),
                                     "GPT 24x256 (small tensors)": (24, 256, 256)}.items():
        grads = [torch.randn(s, device=device) for s in gpt_grad_shapes(layers, d, vocab)]
        numel = sum(g.numel() for g in grads)

        def per_tensor():
            for g in grads:
                all_reduce(g, average=True)

        def bucketed():
            all_reduce_coalesced(grads, bucket_bytes=args.bucket_mb * 2**20, average=True).wait()

        t_plain, t_bucket = _time(per_tensor, args.repeats), _time(bucketed, args.repeats)
        rows.append((name, len(grads), numel, t_plain, t_bucket))
    if rank == 0:
        print(f"\nall-reduce (average) of gradients, {world} x {args.device} ({dist.get_backend()}), "
              f"bucket {args.bucket_mb} MiB, median of {args.repeats}")
        print(f"{'model':<28}{'tensors':>8}{'params':>12}{'per-tensor s':>14}{'bucketed s':>12}{'ratio':>8}")
        for name, n, numel, a, b in rows:
            print(f"{name:<28}{n:>8}{numel / 1e6:>11.1f}M{a:>14.3f}{b:>12.3f}{a / b:>8.2f}")
    finish_rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from pipezero.topology.env import _free_port

    torch.set_num_threads(1)
    mp.spawn(_worker, args=(args.world, _free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
