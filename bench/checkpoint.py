"""Checkpoint save/load: pipezero's safetensors + manifest versus torch.save and torch.distributed.checkpoint.

    python bench/checkpoint.py                    # CPU, gloo, 2 processes
    python bench/checkpoint.py --device cuda      # one process per GPU, nccl

Each rank holds half of a GPT's training state (weights + two Adam moments) under global
names and saves it, then loads the whole checkpoint back (what a reshard does). Peers:
torch.save / torch.load(weights_only=True) of the same dict per rank (no checksums, no
atomic publish), and torch.distributed.checkpoint (DCP, its own format). Prints the median
seconds of each and the ratio to pipezero (> 1: pipezero is faster). pipezero's load
verifies every file's sha256, so it reads each byte twice; the table shows that share.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from pipezero.train.checkpoint import files as ck
from launch import finish_rank, init_rank  # bench/launch.py (bench/ is on sys.path when run as a script)


def gpt_shapes(layers: int, d: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Global parameter name -> shape of a GPT (token + position embedding, blocks)."""
    block = {"ln1.weight": (d,), "ln1.bias": (d,), "qkv.weight": (3 * d, d), "qkv.bias": (3 * d,),
             "proj.weight": (d, d), "proj.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,),
             "fc.weight": (4 * d, d), "fc.bias": (4 * d,), "out.weight": (d, 4 * d), "out.bias": (d,)}
    shapes = {"layers.0.weight": (vocab, d), "layers.0.pos": (1024, d)}
    shapes.update({f"layers.{i + 1}.{k}": s for i in range(layers) for k, s in block.items()})
    return shapes


def training_state(shapes: dict, rank: int, world: int, device: torch.device) -> dict:
    """This rank's share (every world-th parameter) of weights + Adam exp_avg + exp_avg_sq, by global name."""
    g = torch.Generator().manual_seed(rank)
    state = {}
    for name in sorted(shapes)[rank::world]:
        for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq."):
            state[prefix + name] = torch.randn(shapes[name], generator=g).to(device)
    return state


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _methods(root: str, state: dict, everything: dict, rank: int, world: int):
    """(name, save, load) triples; every load returns the merged name -> tensor dict or state."""
    ours, plain, dcp_dir = (os.path.join(root, n) for n in ("pipezero", "torch_save", "dcp"))

    def ours_save():
        ck.save_checkpoint(ours, 1, state, {"step": 1}, rank=rank, world=world)

    def ours_load():
        return ck.load_checkpoint(ours).tensors

    def plain_save():
        os.makedirs(plain, exist_ok=True)
        torch.save(state, os.path.join(plain, f"rank{rank}.pt"))

    def plain_load():
        merged = {}
        for r in range(world):
            merged.update(torch.load(os.path.join(plain, f"rank{r}.pt"), weights_only=True, map_location="cpu"))
        return merged

    def dcp_save():
        dcp.save({"state": state}, checkpoint_id=dcp_dir)

    def dcp_load():
        target = {"state": {k: torch.empty(s) for k, s in everything.items()}}
        dcp.load(target, checkpoint_id=dcp_dir)
        return target["state"]

    return [("pipezero (safetensors+sha256)", ours_save, ours_load),
            ("torch.save / torch.load", plain_save, plain_load),
            ("torch.distributed.checkpoint", dcp_save, dcp_load)]


def _hash_seconds(root: str) -> float:
    path = Path(root, "pipezero", ck.step_dir_name(1))
    start = time.perf_counter()
    for file in sorted(path.glob("*.safetensors")):
        ck._sha256(file)
    return time.perf_counter() - start


def _worker(rank: int, world: int, port: int, args) -> None:
    device = init_rank(rank, world, port, args.device)
    shapes = gpt_shapes(args.layers, args.d_model, 32000)
    state = training_state(shapes, rank, world, device)
    everything = {p + k: s for k, s in shapes.items() for p in ("model.", "optim.exp_avg.", "optim.exp_avg_sq.")}
    numel = sum(v.numel() for v in state.values())
    total = torch.tensor([numel * 4.0])
    dist.all_reduce(total)
    rows = []
    for name, save, load in _methods(args.dir, state, everything, rank, world):
        rows.append((name, _median(save, args.repeats), _median(load, args.repeats)))
    if rank == 0:
        _print(rows, total.item() / 2**20, _hash_seconds(args.dir), world)
    finish_rank()


def _print(rows, mib: float, hash_s: float, world: int) -> None:
    ours_save, ours_load = rows[0][1], rows[0][2]
    print(f"\n{world} ranks, {mib:.0f} MiB of fp32 state in total; load = every rank reads everything")
    print("| method | save s | load s | save ratio (theirs/ours) | load ratio (theirs/ours) |")
    print("|---|---|---|---|---|")
    for name, save, load in rows:
        print(f"| {name} | {save:.3f} | {load:.3f} | {save / ours_save:.2f} | {load / ours_load:.2f} |")
    print(f"\nsha256 of all rank files on one rank: {hash_s:.3f} s ({hash_s / ours_load:.0%} of pipezero's load)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", type=int, default=None, help="processes (default 2, or every GPU)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    owned = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="pipezero-bench-ckpt-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_worker, args=(world, port, args), nprocs=world, join=True)
    finally:
        if owned:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
