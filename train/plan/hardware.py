"""The hardware a plan is for: devices, memory, FLOP/s, links; given or measured here.

Every number is a stated assumption the user can override from `pipezero plan`. The H200
preset follows the vendor's data sheet (141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense bf16,
NVLink 900 GB/s total = 450 GB/s per direction) and a DGX/HGX-style node: 8 GPUs, one
400 Gb/s NIC per GPU (50 GB/s per GPU between nodes). `efficiency` is the fraction of peak a
transformer layer's kernels reach (matmuls, attention, norms together); 0.55 is a round
figure for Hopper at large shapes, the planner's one free parameter at cluster scale.

Host memory (what an offloaded optimizer and checkpointed inputs in pinned memory take, per device):
the presets give each GPU an eighth of a DGX H100 / H200's 2 TB of system memory (both data sheets),
HOST_GB_PER_GPU; a host with less per GPU (one GPU in a 128 GiB machine) says so with `pipezero plan
--host-memory-gb`. Each process also keeps `host_reserved_gb` for itself (the interpreter, torch, the
CUDA context and its pinned pools: bench/long_context.py's allowance).

Measured here, every number is the least of repeated timings (`best_seconds`): on a machine
shared with other work a timing only ever comes out slower than the code's own cost, so the
least is what repeats from run to run, once enough laps agree with it. A measurement whose laps
never settle within the time budget is named in `Hardware.unsettled`, and so is a load average
above the cores (the ranks' contention and gloo's latency are measured as they are, with whatever
else runs: other work makes them, and so the ranking, differ from run to run); `pipezero plan`
prints them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from pipezero.checks import is_int

__all__ = ["CPU_RESERVED_GB", "H200_STEP_BYTES", "HOST_GB_PER_GPU", "Hardware", "best_seconds", "h100", "h200",
           "local_cpu"]

# Bytes one optimizer step moves per parameter in bf16 with fp32 masters, ZeRO 0-2 (pass by
# pass: step_time's module docstring), on a GPU at two thirds of its memory bandwidth: one H200
# stepped the 1.32B GPT in 40-42 ms (bench/RESULTS.md, planner, first GPU run), 3.2 TB/s of 4.8.
H200_STEP_BYTES = 98.0

# A gloo rank's anonymous memory beyond its tensors (gloo buffers, autograd's threads, malloc
# arenas, Python objects made while building): 4.3-7.9 MB over every layout of bench/plan.py
# in two runs on 2026-12-01 (memory does not share the timing's noise); the least of them.
CPU_RESERVED_GB = 0.0043

# Host memory per GPU of the presets: a DGX H100 / H200 node's 2 TB of system memory over its 8 GPUs.
HOST_GB_PER_GPU = 2048.0 / 8


@dataclass(kw_only=True, slots=True, frozen=True)
class Hardware:
    """Devices and links; bandwidths in GB/s per direction per device, latencies in microseconds."""

    name: str
    gpus_per_node: int
    nodes: int = 1
    memory_gb: float                   # usable memory per device
    peak_tflops: float                 # dense peak of the training precision
    efficiency: float = 0.55           # achieved fraction of peak in a layer (modelled time only)
    intra_gbps: float = 450.0          # within a node (NVLink)
    inter_gbps: float = 50.0           # between nodes, per device (one 400 Gb/s NIC each)
    intra_latency_us: float = 3.0
    inter_latency_us: float = 8.0
    optimizer_ns_per_param: float = 0.01   # Adam on the device, per fp32 master parameter
    cpu_adam_ns_per_param: float = 1.0     # offloaded Adam on the host, per parameter (per device)
    pcie_gbps: float = 25.0            # host <-> device, for offload
    memory_gbps: float = 3350.0        # the device's memory bandwidth (a selective recompute's elementwise ops)
    reserved_gb: float = 2.0           # runtime context, communication buffers, allocator slack
    compute_slowdown: float = 1.0      # measured time x this (processes sharing fewer cores)
    layer_overhead_us: float = 30.0    # fixed cost of one layer's F, I or W (kernel launches; 0 when measured)
    optimizer_temp_bytes: float = 4.0  # per parameter, alive for a moment in the optimizer step (torch's foreach
                                       # Adam on a GPU: one fp32 temporary of the shard; a CPU steps tensor by tensor)
    host_offload: bool = True          # whether offloading to a host makes sense (not on a CPU device)
    host_memory_gb: float = HOST_GB_PER_GPU  # host memory per device (a node's RAM / its devices)
    host_reserved_gb: float = 6.0      # the process's own host memory: interpreter, torch, CUDA context
    unsettled: tuple[str, ...] = ()    # why the measurements may not repeat (a busy machine), in words

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes"):
            value = getattr(self, key)
            if not is_int(value, minimum=1):
                raise ValueError(f"Hardware({key}={value!r}): expected a positive integer")
        for key in ("memory_gb", "peak_tflops", "efficiency", "intra_gbps", "inter_gbps", "pcie_gbps",
                    "host_memory_gb"):
            if not getattr(self, key) > 0:
                raise ValueError(f"Hardware({key}={getattr(self, key)!r}): expected a number > 0")
        if not self.host_reserved_gb >= 0:
            raise ValueError(f"Hardware(host_reserved_gb={self.host_reserved_gb!r}): expected a number >= 0")

    @property
    def world(self) -> int:
        """Devices in all."""
        return self.gpus_per_node * self.nodes

    def link(self, span: int) -> tuple[float, float]:
        """(bytes/s, seconds latency) of a group whose ranks are `span` consecutive ranks apart at most."""
        if span <= self.gpus_per_node or self.nodes == 1:
            return self.intra_gbps * 1e9, self.intra_latency_us * 1e-6
        return self.inter_gbps * 1e9, self.inter_latency_us * 1e-6


def h200(nodes: int = 1, gpus_per_node: int = 8) -> Hardware:
    """NVIDIA H200 SXM nodes (see the module docstring for where each number comes from)."""
    return Hardware(name=f"{nodes * gpus_per_node}x H200", gpus_per_node=gpus_per_node, nodes=nodes,
                    memory_gb=141.0, peak_tflops=989.0, optimizer_ns_per_param=H200_STEP_BYTES / (0.66 * 4.8e3),
                    memory_gbps=4800.0)


def h100(nodes: int = 1, gpus_per_node: int = 8) -> Hardware:
    """NVIDIA H100 SXM 80 GB nodes: the H200's compute and links, 80 GB of HBM3 at 3.35 TB/s (data sheet);
    the memory the long-sequence runs were measured on (bench/RESULTS.md)."""
    return Hardware(name=f"{nodes * gpus_per_node}x H100", gpus_per_node=gpus_per_node, nodes=nodes,
                    memory_gb=80.0, peak_tflops=989.0, optimizer_ns_per_param=H200_STEP_BYTES / (0.66 * 3.35e3),
                    memory_gbps=3350.0)


def local_cpu(processes: int = 4, memory_gb: float | None = None) -> Hardware:
    """This machine as `processes` gloo ranks: FLOP/s, Adam, contention and gloo's all-reduce measured.

    The devices are the host: nothing is offloaded (host_offload False), and the host memory per
    process is what the kernel says is available now (MemAvailable) over the processes."""
    import torch

    cores = os.cpu_count() or 1
    if memory_gb is None:
        memory_gb = _ram_gb() / processes
    slowdown, latency, bandwidth = _measure_ranks(processes) if processes > 1 else (1.0, 1e-4, 1e9)
    (tflops, peak_settled), (adam, adam_settled) = _matmul_tflops(torch), _adam_ns(torch)
    unsettled = tuple(f"the {name} timings did not settle" for name, ok in
                      (("matmul peak", peak_settled), ("Adam step", adam_settled)) if not ok) + _busy(cores)
    return Hardware(name=f"{processes} CPU processes on {cores} cores", gpus_per_node=processes,
                    memory_gb=memory_gb, peak_tflops=tflops, efficiency=1.0,
                    intra_gbps=bandwidth / 1e9, intra_latency_us=latency * 1e6,
                    optimizer_ns_per_param=adam, reserved_gb=CPU_RESERVED_GB,
                    compute_slowdown=slowdown, host_offload=False, layer_overhead_us=0.0,
                    optimizer_temp_bytes=0.0, memory_gbps=10.0, unsettled=unsettled,
                    host_memory_gb=_available_gb() / processes, host_reserved_gb=0.0)


def _busy(cores: int) -> tuple[str, ...]:
    """The 1-minute load average, where it says other work shares the cores (else nothing)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return ()
    return (f"load average {load:.1f} on {cores} cores",) if load > cores else ()


def best_seconds(lap: Callable[[], float], least: int = 8, agree: int = 3, within: float = 0.05,
                 budget_s: float = 2.0) -> tuple[float, bool]:
    """(the least of `lap()`'s timings, whether it settled): laps run until at least `least` are done and
    `agree` of them lie within `within` of the least, or until `budget_s` seconds have passed.

    A busy spell of the machine slows every lap it covers; a fixed count of short laps can fall inside
    one spell and return its slowness (the planner's peak moved 100x between runs). Laps go on until
    the least is confirmed by others, so the least is the code's own cost; not settled within the
    budget, the machine stayed busy and the caller says the number is unreliable.
    """
    laps: list[float] = []
    start = time.perf_counter()
    while True:
        laps.append(lap())
        best = min(laps)
        if len(laps) >= least and sum(t <= best * (1 + within) for t in laps) >= agree:
            return best, True
        if time.perf_counter() - start > budget_s:
            return best, False


def _measure_ranks(processes: int, seconds: float = 1.5) -> tuple[float, float, float]:
    """(compute slowdown, collective latency s, bytes/s) of `processes` one-thread gloo ranks here, now.

    The layer times are the least of several runs in one process (model.measure_profile);
    a training step runs `processes` ranks on this machine's cores beside whatever else runs
    here. processes / cores would assume nothing else does; the slowdown is measured instead:
    a copy's mean matmul iteration while all run at once (wall time over iterations done) over
    the lone minimum. Then the same ranks time gloo all-reduces of 1 KB and 4 MB: on a few
    shared cores a collective waits for every peer to be scheduled, milliseconds where a
    loopback link alone would suggest microseconds, and that latency is what tensor- and
    data-parallel layouts pay on every bucket and every block. Each rank keeps its least lap (a busy
    spell only slows a lap), the ranks' median is taken.
    """
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes + 1), ctx.Queue()
    procs = [ctx.Process(target=_rank_loop, args=(r, processes, port, barrier, queue, seconds))
             for r in range(processes)]
    for p in procs:
        p.start()
    barrier.wait()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    alone = best_seconds(_iteration_seconds)[0]
    together, small, large = (sorted(r[i] for r in results)[processes // 2] for i in (0, 1, 2))
    hops = 2 * (processes - 1)  # a ring all-reduce
    latency = small / hops
    bandwidth = hops / processes * 4 * 2**20 / max(large - small, 1e-6)
    return max(1.0, together / alone), latency, bandwidth


def _rank_loop(rank: int, world: int, port: int, barrier, queue, seconds: float) -> None:
    """A child of _measure_ranks: matmuls while the others do, then timed gloo all-reduces."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _iteration_seconds()  # warm-up
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    barrier.wait()
    start, done = time.perf_counter(), 0
    while time.perf_counter() < start + seconds:
        _iteration_seconds()
        done += 1
    iteration = (time.perf_counter() - start) / done
    times = {}
    for numel, n in ((256, 20), (1 << 20, 5)):
        t = torch.ones(numel)
        dist.all_reduce(t)  # warm-up
        laps = []
        for _ in range(n):
            start = time.perf_counter()
            dist.all_reduce(t)
            laps.append(time.perf_counter() - start)
        times[numel] = min(laps)  # a lap is only ever slowed by other work: the least is the collective's own
    dist.destroy_process_group()
    queue.put((iteration, times[256], times[1 << 20]))


def _iteration_seconds() -> float:
    import torch

    a = torch.ones(128, 128)
    start = time.perf_counter()
    for _ in range(8):
        a @ a
    return time.perf_counter() - start


def _ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return 8.0


def _available_gb() -> float:
    """/proc/meminfo's MemAvailable in GB (the physical memory where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024 / 1e9
    except (OSError, KeyError, ValueError):
        return _ram_gb()


def _matmul_tflops(torch) -> tuple[float, bool]:
    """One thread's best fp32 matmul rate here over two sizes (the layers are timed on one thread too),
    and whether its timings settled. Larger GEMMs run nearer the peak, so the better size is kept."""
    rates, settled = [], True
    for n in (256, 512):
        a = torch.randn(n, n)
        a @ a  # warm-up

        def lap() -> float:
            start = time.perf_counter()
            a @ a
            return time.perf_counter() - start
        seconds, ok = best_seconds(lap)
        rates.append(2 * n ** 3 / seconds / 1e12)
        settled = settled and ok
    return max(rates), settled


def _adam_ns(torch) -> tuple[float, bool]:
    """torch AdamW's step time per parameter here, and whether its timings settled."""
    p = torch.nn.Parameter(torch.zeros(1 << 18))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p])
    opt.step()  # warm-up: the state is created in the first step

    def lap() -> float:
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start
    seconds, settled = best_seconds(lap)
    return seconds / p.numel() * 1e9, settled
