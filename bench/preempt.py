"""What preemption's per-step agreement costs: Preemption.requested(), one all-reduce of one integer.

    torchrun --standalone --nproc-per-node 2 bench/preempt.py               # gloo on CPU, NCCL on GPUs
    torchrun --standalone --nproc-per-node 2 bench/preempt.py --laps 2000

Prints the median and 90th percentile of requested() over --laps calls on every rank's device (on a
GPU each call also waits for the device, as the loop's loss.item() does every step anyway), beside
(printed alone: the number is the agreement's own cost per training step).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from pipezero.topology import process_device
from pipezero.train.preempt import Preemption


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--laps", type=int, default=1000)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = process_device()
    stop = Preemption(True, device)
    for _ in range(50):  # warm-up: NCCL's communicator, gloo's pairs
        stop.requested()
    laps = []
    for _ in range(args.laps):
        start = time.perf_counter()
        stop.requested()
        laps.append(time.perf_counter() - start)
    stop.restore()
    laps.sort()
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {device.type} ({dist.get_backend()}): requested() median "
              f"{laps[len(laps) // 2] * 1e6:.0f} us, p90 {laps[len(laps) * 9 // 10] * 1e6:.0f} us over {args.laps} laps")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
