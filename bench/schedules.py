"""Schedules side by side: pipezero's against torch.distributed.pipelining's of the same name.

Both are turned into the same action lists and run through pipezero's simulator with the
same per-chunk costs, so the table compares the schedules themselves (bubble, peak live
activations, makespan, whether the orders are identical), not two executors; it also times
building a schedule (ours vs torch's) and validating ours.
Torch's pipeline orders are read from its schedule classes without a process group (the
classes are created bare and only their order-building method is called).

    python bench/schedules.py                   # p in 2 4 8, m in 8 16 32
    python bench/schedules.py --stages 4 --microbatches 8 --p2p 0.1

Schedules are pure data: there is nothing to run on a GPU; `--device` is accepted for a
uniform bench interface and ignored.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from pipezero.pipe import (Action, Costs, DualPipeV, GPipe, Interleaved1F1B, OneFOneB, Op, ScheduleError,
                           ZeroBubbleH1, ZeroBubbleV, simulate, validate)
from pipezero.pipe.schedule.placement import owner

try:
    import torch.distributed.pipelining.schedules as tps
except ImportError:  # pragma: no cover
    tps = None

_TORCH_OPS = {"F": Op.FORWARD, "B": Op.BACKWARD, "I": Op.BACKWARD_INPUT, "W": Op.BACKWARD_WEIGHT}


def torch_order(name: str, p: int, m: int) -> tuple[dict[int, list[Action]], str]:
    """torch's pipeline_order for `name` as pipezero actions, and its placement."""
    if name == "Interleaved1F1B":
        sched = object.__new__(tps.ScheduleInterleaved1F1B)
        rounds = max(1, m // p)
        sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, 2, m
        sched.microbatches_per_round = m // rounds
        placement = "looped"
    elif name == "ZeroBubbleV":
        sched = object.__new__(tps.ScheduleZBVZeroBubble)
        sched.pp_group_size, sched.num_stages, sched._n_microbatches = p, 2 * p, m
        placement = "v"
    elif name == "DualPipeV":
        sched = object.__new__(tps.ScheduleDualPipeV)
        sched.pp_group_size, sched._n_microbatches = p, m
        placement = "v"
    else:
        raise ValueError(name)
    out = {}
    for rank in range(p):
        acts = []
        for step in sched._calculate_single_rank_operations(rank):
            for a in () if step is None else (step.sub_actions or (step,)):  # overlapped: F, B
                r, chunk = owner(a.stage_index, p, placement)
                assert r == rank
                acts.append(Action(_TORCH_OPS[a.computation_type.value], chunk, a.microbatch_index))
        out[rank] = acts
    return out, placement


def _time(fn: Callable[[], Any], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def compare(name: str, ours: Any, p: int, m: int, costs: Costs) -> dict[str, Any]:
    theirs, placement = torch_order(name, p, m)
    a = simulate(ours, p, costs)
    b = simulate(theirs, p, costs, placement)
    t_ours = _time(lambda: ours.actions(p))
    t_validate = _time(lambda: validate(ours.actions(p), p, ours))
    t_theirs = _time(lambda: torch_order(name, p, m))
    return {"schedule": name, "p": p, "m": m,
            "bubble": a.bubble, "torch_bubble": b.bubble,
            "peak": max(a.peak_activations.values()), "torch_peak": max(b.peak_activations.values()),
            "makespan_ratio": a.makespan / b.makespan, "same": ours.actions(p) == theirs,
            "build_ms": 1e3 * t_ours, "torch_build_ms": 1e3 * t_theirs,
            "validate_ms": 1e3 * t_validate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--microbatches", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--p2p", type=float, default=0.0, help="p2p latency in units of one chunk forward")
    ap.add_argument("--device", default="cpu", help="ignored: schedules are pure data")
    args = ap.parse_args()
    if tps is None:
        raise SystemExit("torch.distributed.pipelining is not importable")
    costs = Costs(forward=1, backward_input=1, backward_weight=1, p2p=args.p2p)
    head = (f"{'schedule':<16}{'p':>3}{'m':>4}{'bubble':>9}{'torch':>9}{'peak':>6}{'torch':>7}"
            f"{'makespan ours/torch':>21}{'same order':>12}{'build ms':>10}{'torch':>8}"
            f"{'ratio':>7}{'validate ms':>13}")
    print(f"costs per chunk action: {costs}")
    print(head)
    for p in args.stages:
        for m in args.microbatches:
            for name, ours in (("Interleaved1F1B", Interleaved1F1B(m)), ("ZeroBubbleV", ZeroBubbleV(m)),
                               ("DualPipeV", DualPipeV(m))):
                if (name == "Interleaved1F1B" and m % p) or (name == "DualPipeV" and m < 2 * p):
                    continue
                row = compare(name, ours, p, m, costs)
                print(f"{name:<16}{p:>3}{m:>4}{row['bubble']:>9.4f}{row['torch_bubble']:>9.4f}"
                      f"{row['peak']:>6}{row['torch_peak']:>7}{row['makespan_ratio']:>21.3f}"
                      f"{str(row['same']):>12}{row['build_ms']:>10.2f}{row['torch_build_ms']:>8.2f}"
                      f"{row['build_ms'] / row['torch_build_ms']:>7.2f}{row['validate_ms']:>13.2f}")
    executor_table(args.stages, args.microbatches, args.p2p)


def executor_table(stages: list[int], microbatches: list[int], p2p: float) -> None:
    """Bubble of every schedule under two executor models, at equal work per rank.

    async/kind: sends never hold up the sender, one ordered channel per rank pair and
    direction of data (activations, gradients); blocking/pair: a send holds up the sender
    until the receiver posts the receive, one untagged channel per rank pair.
    """
    print("\nbubble by executor model (one-chunk schedules cost F=I=W=2, two-chunk ones 1 per chunk)")
    print(f"{'schedule':<16}{'p':>3}{'m':>4}{'async/kind':>12}{'blocking/pair':>15}")
    for p in stages:
        for m in microbatches:
            for sched in (GPipe(m), OneFOneB(m), ZeroBubbleH1(m), Interleaved1F1B(m), ZeroBubbleV(m),
                          DualPipeV(m)):
                if (isinstance(sched, Interleaved1F1B) and m % p) or (isinstance(sched, DualPipeV) and m < 2 * p):
                    continue
                unit = 2.0 / sched.num_chunks
                costs = Costs(forward=unit, backward_input=unit, backward_weight=unit, p2p=p2p)
                cells = []
                for channels, sends in (("kind", "async"), ("pair", "blocking")):
                    try:
                        cells.append(f"{simulate(sched, p, costs, channels=channels, sends=sends).bubble:.4f}")
                    except ScheduleError as e:
                        cells.append("deadlock" if "deadlock" in e.reason else "order")
                print(f"{type(sched).__name__:<16}{p:>3}{m:>4}{cells[0]:>12}{cells[1]:>15}")


if __name__ == "__main__":
    main()
