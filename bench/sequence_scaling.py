"""Sequence parallelism on several GPUs (issue 48): Ulysses beside data parallel and DeepSpeed ALST, pipe 2 x
sequence 2 under ZB-V and DualPipeV, the longest sequence, each beside the planner's prediction.

    python bench/sequence_scaling.py --tiny                  # CPU, gloo, 2 processes, the tiny Llama, 512 tokens
    python bench/sequence_scaling.py --tiny --nproc 4        # ... and pipe 2 x sequence 2 (4 processes)
    python bench/sequence_scaling.py                         # a process per GPU: Llama-3-8B's shape, 64K, bf16
    python bench/sequence_scaling.py --cases pipe --layers 8
    python bench/sequence_scaling.py --cases longest --lengths 131072 262144 524288

Cases (--cases; every one on all N processes, ZeRO-3 over data x sequence, AdamW with fp32 masters):
  sequence  ulysses-D   Grid(sequence=D, data=N/D) for D = 2 / 4 / 8 (those N and the heads allow): Ulysses
                        around the Llama's attention, each row split in D slices (bench/sequence_cases.py)
            data        Grid(data=N): every rank a whole row (the same rows a step: N, so the same tokens)
            alst-D      DeepSpeed 0.19.8's ALST at degree D (bench/long_context_alst.alst_sp_step): its
                        Ulysses, TiledMLP, tiled logits + loss, checkpoints with their inputs on the host
  pipe      pipe2-S     pipe 2 x data N/2 under schedule S (zbv, dualpipev), 2N rows a step
            pipe2-seq2-S  pipe 2 x sequence 2 x data N/4 (4 or 8 processes), the same 2N rows
  longest   longest-L   Ulysses over the N processes (the largest degree the heads allow), one row of L
                        tokens; --lengths walked up, one fresh launch each, until one does not train
                        (out of memory, a failure, the planner's host memory above what the host has, or
                        --timeout)
Every pipezero case runs with one memory kit (--kit; auto: the first of layers checkpointed with their
inputs on the device / on the host / and the optimizer on the host that the planner says fits every case
of the invocation; the longest walk: the last). Each case is a fresh torchrun launch (--tiny: one launch
for all, to save the interpreter starts), one warm-up step, then --steps timed steps.

Columns: tokens/s/GPU (the step's tokens / the median step's seconds, the slowest rank, / N); peak GB
(CUDA: max allocated, the fullest rank; CPU: the process's max RSS so far, interpreter included);
planner s / planner GB: pipezero.train.plan.predict for the same layout (Layout with pipe, data,
sequence, schedule, micro-batches, ZeRO-3 and the kit) on an H100 / H200 node of N (modelled from the
FLOPs) or, on CPU, this machine as N processes (hardware.local_cpu); ALST rows have none (the planner
models pipezero); stage MB/mb: the bytes one rank sends the other stage per micro-batch (activations
forward, their gradients backward), counted by comm's TRAFFIC from the tensors the runner hands to P2P;
vs data / vs alst: tokens/s/GPU over the data-parallel row's and over ALST's at the same degree.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context import host_available_gib  # noqa: E402
from sequence_cases import Case, Kit, Options, hf_config, run_cases  # noqa: E402

DEGREES = (2, 4, 8)
KITS = {"device": Kit(), "host": Kit(host_inputs=True), "host+optimizer": Kit(host_inputs=True,
                                                                              offload_optimizer=True)}
GPU = dict(shape="llama3-8b", length=65536)
TINY = dict(shape="tiny", length=512)


def sequence_cases(world: int, heads: int) -> list[Case]:
    """Ulysses at each degree the world and the heads allow, data parallel, ALST at the same degrees."""
    degrees = [d for d in DEGREES if d <= world and world % d == 0 and heads % d == 0]
    ulysses = [Case(f"ulysses-{d}", sequence=d, rows=world) for d in degrees]
    return ulysses + [Case("data", rows=world)] + [Case(f"alst-{d}", sequence=d, rows=world, alst=True)
                                                   for d in degrees]


def pipe_cases(world: int) -> list[Case]:
    """Pipe 2 without and with a sequence axis of 2, under ZB-V and DualPipeV, 2N rows a step."""
    if world % 2:
        return []
    sequences = (1, 2) if world % 4 == 0 else (1,)
    return [Case(f"pipe2{'-seq2' if s > 1 else ''}-{name}", pipe=2, sequence=s, schedule=name, rows=2 * world)
            for s in sequences for name in ("zbv", "dualpipev")]


def longest_cases(world: int, heads: int, lengths: list[int]) -> list[Case]:
    """One row of each length, Ulysses over the largest degree of the world the heads allow."""
    degree = max(d for d in range(1, world + 1) if world % d == 0 and heads % d == 0)
    return [Case(f"longest-{length}", sequence=degree, rows=world // degree, length=length) for length in lengths]


def _shape(options: Options, length: int):
    from pipezero.train.plan.model import ModelShape

    return ModelShape.from_hf_config(hf_config(options, length), length, name=options.shape)


def hardware(world: int, cuda: bool):
    """The planner's hardware: an H100 / H200 node of `world` (modelled), or this CPU as `world` processes."""
    from pipezero.train.plan.hardware import h100, h200, local_cpu

    if not cuda:
        return local_cpu(world)
    return (h200 if "H200" in torch.cuda.get_device_name() else h100)(1, world)


def predict_case(case: Case, options: Options, kit: Kit, world: int, hw, precision: str):
    """The planner's Prediction for a pipezero case (None for ALST)."""
    from pipezero.train.plan import predict
    from pipezero.train.plan.layout import Layout
    from pipezero.train.plan.model import flops_profile

    if case.alst:
        return None
    shape = _shape(options, case.length or options.length)
    layout = Layout(pipe=case.pipe, data=case.data(world), tensor=1, schedule=case.schedule, chunks=case.chunks(),
                    microbatches=case.microbatches(world), microbatch_size=1, zero=3,
                    offload=kit.offload_optimizer, checkpoint=int(kit.checkpoint), sequence=case.sequence,
                    host_inputs=kit.host_inputs)
    return predict(flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency), layout, hw, shape, precision)


def choose_kit(name: str, cases: list[Case], options: Options, world: int, hw, precision: str) -> Kit:
    """--kit's Kit; auto: the first the planner says fits every pipezero case (on CPU: the device's)."""
    if name != "auto":
        return KITS[name]
    kits = list(KITS.values()) if hw.host_offload else [KITS["device"]]
    for kit in kits:
        if all(p is None or p.fits for p in (predict_case(c, options, kit, world, hw, precision) for c in cases)):
            return kit
    return kits[-1]


# -- launching: one torchrun group per case (or per invocation with --tiny) ---------------------------
def launch(cases: list[Case], options: Options, nproc: int, timeout: float) -> list[dict]:
    """Run cases in a fresh torchrun group of nproc; a result per case (its error if it did not end)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"cases": [asdict(c) for c in cases], "options": asdict(options)}, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(__file__), "--worker", f.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        why = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: their own session
        out, err = proc.communicate()
        why = f"timed out after {timeout:.0f} s"
    finally:
        os.unlink(f.name)
    done = {r["case"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    why = why or _failure(err, proc.returncode)
    return [done.get(c.name) or {"case": c.name, "error": why} for c in cases]


def _failure(stderr: str, code: int) -> str:
    """What stopped a launch, from its stderr: out of memory, or its last error line."""
    if "OutOfMemoryError" in stderr or "out of memory" in stderr or code in (-9, 137):
        return "out of memory"
    lines = [line.strip() for line in stderr.splitlines() if "Error" in line or "error" in line]
    return (lines or [f"failed (exit {code})"])[-1][:200]


def worker(path: str) -> None:
    """A torchrun worker: the cases of `path` in this group; rank 0 prints a JSON line per case."""
    from pipezero.topology.env import init_distributed

    with open(path) as f:
        spec = json.load(f)
    cases = [Case(**c) for c in spec["cases"]]
    options = Options(**dict(spec["options"], kit=Kit(**spec["options"]["kit"])))
    init_distributed()
    run_cases(cases, options, emit=lambda r: print(json.dumps(r), flush=True))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# -- the table -----------------------------------------------------------------------------------------
def _layout(case: Case, world: int) -> str:
    axes = [f"{k} {v}" for k, v in (("pipe", case.pipe), ("data", case.data(world)), ("sequence", case.sequence))
            if v > 1] or ["1 process"]
    runtime = "ALST" if case.alst else case.schedule if case.pipe > 1 else "pipezero"
    return f"{' x '.join(axes)}, {runtime}, m{case.microbatches(world)}"


def table(cases: list[Case], results: dict, preds: dict, world: int) -> str:
    """The Markdown table of the cases that ran or said why not."""
    lines = ["| case | layout | tokens/s/GPU | step s | planner s | peak GB | planner GB | stage MB/mb | vs data "
             "| vs alst |", "|---|---|---|---|---|---|---|---|---|---|"]
    data = results.get("data", {}).get("tokens_per_s_gpu")
    for case in cases:
        r, p = results.get(case.name, {}), preds.get(case.name)
        if "error" in r:
            lines.append(f"| {case.name} | {_layout(case, world)} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        rate = r.get("tokens_per_s_gpu")
        alst = results.get(f"alst-{case.sequence}", {}).get("tokens_per_s_gpu")
        cells = [f"{rate:,.0f}" if rate else "-", _num(r.get("seconds"), 2), _num(p and p.time.total, 2),
                 _num(r.get("peak_gb"), 2), _num(p and p.memory.total / 1e9, 2),
                 _num(r["stage_bytes_mb"] / 2**20 if r.get("stage_bytes_mb") else None, 2),
                 _ratio(rate, data) if case.name.startswith("ulysses") else "",
                 _ratio(rate, alst) if case.name.startswith("ulysses") else ""]
        lines.append(f"| {case.name} | {_layout(case, world)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


# -- the runs ------------------------------------------------------------------------------------------
def _host_refusal(pred, world: int) -> str | None:
    """The planner's host memory for the whole node above what the host has now: the reason, else None."""
    if pred is None:
        return None
    need, available = pred.memory.host.total * world / 2**30, host_available_gib()
    if need <= available:
        return None
    return f"refused: the planner puts {need:.0f} GiB on the host, {available:.0f} GiB available"


def run_group(cases: list[Case], options: Options, args, world: int, preds: dict, walk: bool = False) -> dict:
    """Each case in a fresh launch (all in one with --tiny); a walk stops at the first that does not train."""
    from long_context_alst import unavailable

    results: dict = {}
    ready = []
    for case in cases:
        reason = (unavailable() if case.alst else None) or _host_refusal(preds.get(case.name), world)
        if reason:
            results[case.name] = {"case": case.name, "error": reason}
            if walk:
                return results
        else:
            ready.append(case)
    groups = [ready] if args.tiny and not walk else [[c] for c in ready]
    for group in groups:
        for r in launch(group, options, world, args.timeout):
            results[r["case"]] = r
            print(f"  {r['case']}: {r.get('error') or format(r['tokens_per_s_gpu'], ',.0f') + ' tokens/s/GPU'}",
                  flush=True)
        if walk and "error" in results[group[-1].name]:
            break
    return results


def planner_longest(options: Options, kit: Kit, world: int, heads: int, hw, precision: str, start: int) -> int:
    """The longest length (start doubled) whose row the planner says fits (device and host), 0 if none."""
    longest, length = 0, start
    while length <= 1 << 26:
        case = longest_cases(world, heads, [length])[0]
        pred = predict_case(case, options, kit, world, hw, precision)
        if not pred.fits or _host_refusal(pred, world):
            break
        longest, length = length, 2 * length
    return longest


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, gloo, the tiny Llama at 512 tokens (a smoke run)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: the GPUs; --tiny: 2)")
    p.add_argument("--cases", nargs="+", default=["sequence", "pipe"], choices=["sequence", "pipe", "longest"])
    p.add_argument("--only", nargs="+", default=None, help="case names to keep (e.g. ulysses-4 data alst-4)")
    p.add_argument("--layers", type=int, default=None, help="the shape's depth cut to N layers (same width)")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (default 65536; --tiny 512)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="the longest walk's lengths, ascending")
    p.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up (0: time the warm-up)")
    p.add_argument("--kit", default="auto", choices=["auto", *KITS])
    p.add_argument("--timeout", type=float, default=400.0, help="seconds a launch may take before it is killed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    cuda = torch.cuda.is_available() and not args.tiny
    world = args.nproc or (torch.cuda.device_count() if cuda else 2)
    base = TINY if args.tiny or not cuda else GPU
    options = Options(shape=base["shape"], layers=args.layers, length=args.length or base["length"],
                      steps=args.steps)
    heads = hf_config(options, options.length).num_attention_heads
    lengths = args.lengths or ([options.length * k for k in (1, 2, 4)] if args.tiny
                               else [131072, 262144, 524288, 1048576])
    groups = {"sequence": sequence_cases(world, heads), "pipe": pipe_cases(world),
              "longest": longest_cases(world, heads, lengths)}
    precision = "bf16" if cuda else "fp32"
    hw = hardware(world, cuda)
    device = torch.cuda.get_device_name() if cuda else "CPU (fp32, gloo)"
    depth = f", {args.layers} layers" if args.layers else ""
    print(f"{options.shape} Llama{depth} on {world} x {device}; the planner's hardware: {hw.name}")
    for name in args.cases:
        cases = [c for c in groups[name] if not args.only or c.name in args.only]
        if not cases:
            print(f"\n{name}: no case for {world} processes" + (" (pipe 2 x sequence 2 needs 4)" if name == "pipe"
                                                                 else ""))
            continue
        walk = name == "longest"
        kit_name = "host+optimizer" if walk and args.kit == "auto" and hw.host_offload else args.kit
        kit = choose_kit(kit_name, cases, options, world, hw, precision)
        run_options = replace(options, kit=kit, steps=0 if walk and args.steps == 1 else args.steps)
        preds = {c.name: predict_case(c, run_options, kit, world, hw, precision) for c in cases}
        print(f"\n{name}: {cases[0].rows if not walk else 1} row(s) of "
              f"{'--lengths' if walk else options.length} tokens a step; pipezero's kit: {kit.label}", flush=True)
        results = run_group(cases, run_options, args, world, preds, walk)
        print(table([c for c in cases if c.name in results], results, preds, world))
        if walk:
            most = planner_longest(options, kit, world, heads, hw, precision, lengths[0])
            print(f"the planner's longest row that fits {world} x {hw.name.split(' ', 1)[-1]}: "
                  f"{most:,} tokens (doubling from {lengths[0]:,})")


if __name__ == "__main__":
    main()
