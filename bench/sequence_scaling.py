"""Sequence parallelism on several GPUs (issue 48): Ulysses beside data parallel and DeepSpeed ALST, pipe 2 x
sequence 2 under ZB-V and DualPipeV, the longest sequence, each beside the planner's prediction.

    python bench/sequence_scaling.py --tiny                  # CPU, gloo, 2 processes, the tiny Llama, 512 tokens
    python bench/sequence_scaling.py --tiny --nproc 4        # ... and pipe 2 x sequence 2 (4 processes)
    python bench/sequence_scaling.py                         # a process per GPU: Llama-3-8B's shape, 64K, bf16
    python bench/sequence_scaling.py --cases pipe --layers 8
    python bench/sequence_scaling.py --cases longest --lengths 131072 262144 524288
    python bench/sequence_scaling.py --plan-only h100 --nproc 8 --layers 8   # no GPU: the planner's columns

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
models pipezero); stage MiB/mb: the MiB one rank sends the other stage per micro-batch (the hidden states
and position ids forward, the hidden states' gradient backward), counted by comm's TRAFFIC from the
tensors the runner hands to P2P (numel x element size);
vs data / vs alst: tokens/s/GPU over the data-parallel row's and over ALST's at the same degree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace

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
    """Data parallel, Ulysses at each degree the world and the heads allow, ALST at the same degrees."""
    degrees = [d for d in DEGREES if d <= world and world % d == 0 and heads % d == 0]
    ulysses = [Case(f"ulysses-{d}", sequence=d, rows=world) for d in degrees]
    return [Case("data", rows=world)] + ulysses + [Case(f"alst-{d}", sequence=d, rows=world, alst=True)
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


def hardware(world: int, cuda: bool, preset: str | None = None):
    """The planner's hardware: an H100 / H200 node of `world` (modelled) with this host's available memory
    over its processes (the presets assume a DGX's 256 GB a GPU), or this CPU as `world` processes;
    `preset` (--plan-only): that node as the preset has it."""
    from pipezero.train.plan.hardware import h100, h200, local_cpu

    if preset:
        return (h200 if preset == "h200" else h100)(1, world)
    if not cuda:
        return local_cpu(world)
    node = (h200 if "H200" in torch.cuda.get_device_name() else h100)(1, world)
    return replace(node, host_memory_gb=host_available_gib() * 2**30 / 1e9 / world)


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
    """Run cases in a fresh torchrun group of nproc, killed after `timeout` s; a result per case (its error if
    it did not end)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"cases": [asdict(c) for c in cases], "options": asdict(options)}, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(__file__), "--worker", f.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _RUNNING[:] = [proc]
    try:
        out, err = proc.communicate(timeout=timeout)
        why = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: their own session
        out, err = proc.communicate()
        why = f"timed out after {timeout:.0f} s"
    finally:
        os.unlink(f.name)
        _RUNNING.clear()
    done = {r["case"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    if len(done) < len(cases):  # the first worker's traceback, for the log (gpu.sh keeps stderr)
        lines = err.splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 40))
        names = ", ".join(c.name for c in cases)
        print(f"--- the launch of {names}, its stderr:", *lines[first:first + 60], "---", sep="\n",
              file=sys.stderr, flush=True)
    results, why = [], why or _failure(err, proc.returncode)
    for case in cases:  # the first case without a line ended the launch; the rest never started
        results.append(done.get(case.name) or {"case": case.name, "error": why})
        if case.name not in done:
            why = f"not run: {case.name} ended its launch"
    return results


_RUNNING: list[subprocess.Popen] = []  # the launch under way


def _stop(signum, frame) -> None:
    """SIGTERM (gpu.sh's timeout): end the launch under way too (its own session would outlive us)."""
    for proc in _RUNNING:
        os.killpg(proc.pid, signal.SIGKILL)
    print(f"stopped by signal {signum}: the rows above are what ran", flush=True)
    raise SystemExit(128 + signum)


def _failure(stderr: str, code: int) -> str:
    """What stopped a launch, from its stderr: out of memory, a worker killed (the host's OOM killer, most
    likely), or the first exception a worker raised (the root cause; torchrun's own comes after)."""
    if "OutOfMemoryError" in stderr or "out of memory" in stderr:
        return "out of memory"
    if "SIGKILL" in stderr or "exitcode  : -9" in stderr or code in (-9, 137):
        return "a worker was killed (SIGKILL: the host out of memory?)"
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in stderr.splitlines()]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*: ", line)
              and "ChildFailedError" not in line]
    return (raised or [f"failed (exit {code})"])[0][:300]


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


HEADER = ("| case | layout | tokens/s/GPU | step s | planner s | peak GB | planner GB | stage MiB/mb | vs base "
          "| vs alst |\n|---|---|---|---|---|---|---|---|---|---|")


def base_of(case: Case) -> str | None:
    """The case a row is compared with: data parallel for Ulysses, pipe 2 alone for pipe 2 x sequence 2."""
    if case.name.startswith("ulysses"):
        return "data"
    return f"pipe2-{case.schedule}" if case.pipe > 1 and case.sequence > 1 else None


def row(case: Case, results: dict, pred, world: int) -> str:
    """A case's table row: its numbers, the planner's, and its ratios to the rows in `results`."""
    r, head = results.get(case.name, {}), f"| {case.name} | {_layout(case, world)} | "
    if "error" in r:
        return head + f"{r['error']} |  |  |  |  |  |  |  |"
    rate, base = r.get("tokens_per_s_gpu"), base_of(case)
    cells = [f"{rate:,.0f}" if rate else "-", _num(r.get("seconds"), 2), _num(pred and pred.time.total, 2),
             _num(r.get("peak_gb"), 2), _num(pred and pred.memory.total / 1e9, 2),
             _num(r["stage_bytes_mb"] / 2**20 if r.get("stage_bytes_mb") else None, 2),
             _ratio(rate, results.get(base, {}).get("tokens_per_s_gpu")) if base else "",
             _ratio(rate, results.get(f"alst-{case.sequence}", {}).get("tokens_per_s_gpu"))
             if case.name.startswith("ulysses") else ""]
    return head + " | ".join(cells) + " |"


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


@dataclass
class Group:
    """One --cases group as planned: its cases, the kit, the options they run with, the planner's predictions."""

    name: str
    cases: list[Case]
    options: Options
    preds: dict
    ran: list[str] = field(default_factory=list)  # the cases with a row from this invocation, in order

    @property
    def walk(self) -> bool:
        return self.name == "longest"


def _refusals(group: Group, world: int, known: dict) -> list[Case]:
    """Record why a case cannot run here (ALST without deepspeed, the host too small); the cases that can, in order
    (a walk: those before its first refusal)."""
    from long_context_alst import unavailable

    ready = []
    for case in group.cases:
        reason = (unavailable(need_cuda=False) if case.alst else None) or _host_refusal(group.preds.get(case.name),
                                                                                        world)
        if reason:
            _record(group, {"case": case.name, "error": reason}, known, world)
            if group.walk:
                break
        else:
            ready.append(case)
    return ready


def _launches(groups: list[Group], args, world: int, known: dict) -> list[tuple[list[Case], list[Group]]]:
    """(cases, the group of each) per launch: a case each, or with --one-launch (--tiny's) one for the
    pipezero cases of every group but the walk (ALST registers its attention in transformers for the
    process: a launch each)."""
    shared: list[tuple[list[Case], list[Group]]] = []  # one launch per set of options
    single: list[tuple[list[Case], list[Group]]] = []
    for group in groups:
        ready = _refusals(group, world, known)
        together = [] if group.walk or not args.one_launch else [c for c in ready if not c.alst]
        same = next((other for other in shared if other[1][0].options == group.options), None)
        if together and same:
            same[0].extend(together)
            same[1].extend([group] * len(together))
        elif together:
            shared.append((together, [group] * len(together)))
        single += [([case], [group]) for case in ready if case not in together]
    return shared + single


def run_groups(groups: list[Group], args, world: int, known: dict) -> None:
    """Launch every case (a walk stops at the first length that does not train), a row as each ends."""
    stopped: set[str] = set()
    for cases, owners in _launches(groups, args, world, known):
        if owners[0].name in stopped:
            continue
        for result, owner in zip(launch(cases, owners[0].options, world, args.timeout * len(cases)), owners):
            _record(owner, result, known, world)
            if owner.walk and "error" in result:
                stopped.add(owner.name)
        if args.save:
            save(args.save, args.key, known)


_PRINTED: list[str] = []  # the group whose rows were printed last


def _record(group: Group, result: dict, known: dict, world: int) -> None:
    """Keep a result and print its row (a header before it when another group's row came last): a run cut
    short keeps the rows it printed."""
    if _PRINTED[-1:] != [group.name]:
        print(f"\n{group.name}:\n{HEADER}")
        _PRINTED.append(group.name)
    name = result["case"]
    known[name] = result
    group.ran.append(name)
    case = next(c for c in group.cases if c.name == name)
    print(row(case, known, group.preds.get(name), world), flush=True)


def load(path: str, key: str) -> dict:
    """The results a --save file holds for this setup (shape, depth, length, world), {} if none."""
    try:
        with open(path) as f:
            return json.load(f).get(key, {})
    except (OSError, ValueError):
        return {}


def save(path: str, key: str, known: dict) -> None:
    """Keep this setup's results in the --save file beside other setups' (later runs compare with them)."""
    try:
        with open(path) as f:
            everything = json.load(f)
    except (OSError, ValueError):
        everything = {}
    everything[key] = known
    with open(path, "w") as f:
        json.dump(everything, f, indent=1)


def planner_longest(options: Options, kit: Kit, world: int, heads: int, hw, precision: str, start: int) -> int:
    """The longest length (start doubled) whose row the planner says fits (device and host), 0 if none."""
    longest, length = 0, start
    while length <= 1 << 26:
        case = longest_cases(world, heads, [length])[0]
        if not predict_case(case, options, kit, world, hw, precision).fits:  # the hardware's host memory too
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
    p.add_argument("--timeout", type=float, default=400.0,
                   help="seconds a case may take before its launch is killed (a launch of k cases: k times)")
    p.add_argument("--one-launch", action="store_true",
                   help="the pipezero cases in one launch (fewer starts; peak memory reset between them; an out of "
                   "memory ends the rest): --tiny's")
    p.add_argument("--save", default=None,
                   help="a JSON file that keeps the results: ratios to rows of earlier runs of the same shape, depth, "
                   "length and processes (ALST in a call of its own)")
    p.add_argument("--plan-only", default=None, choices=["h100", "h200"],
                   help="run nothing: the planner's prediction of every case on a node of --nproc (default 8) "
                   "such GPUs, the GPU defaults (to size a device call beforehand)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    args.one_launch = args.one_launch or args.tiny
    signal.signal(signal.SIGTERM, _stop)
    cuda = (torch.cuda.is_available() and not args.tiny) or bool(args.plan_only)
    world = args.nproc or (8 if args.plan_only else torch.cuda.device_count() if cuda else 2)
    base = TINY if args.tiny or not cuda else GPU
    options = Options(shape=base["shape"], layers=args.layers, length=args.length or base["length"],
                      steps=args.steps)
    heads = hf_config(options, options.length).num_attention_heads
    lengths = args.lengths or ([options.length * k for k in (1, 2, 4)] if args.tiny
                               else [131072, 262144, 524288, 1048576])
    precision = "bf16" if cuda else "fp32"
    hw = hardware(world, cuda, args.plan_only)
    device = args.plan_only or (torch.cuda.get_device_name() if cuda else "CPU (fp32, gloo)")
    depth = f", {args.layers} layers" if args.layers else ""
    print(f"{options.shape} Llama{depth} on {world} x {device}; the planner's hardware: {hw.name}")
    args.key = f"{options.shape} {args.layers or 'all'} layers, {options.length} tokens, {world} processes"
    groups = plan_groups(args, options, world, heads, lengths, hw, precision)
    if args.plan_only:
        return _print_plan(groups, options, world, heads, lengths, hw, precision)
    known = load(args.save, args.key) if args.save else {}
    run_groups(groups, args, world, known)
    saved = f" (and {args.save}'s)" if args.save else ""
    print(f"\nthe tables again, every ratio from the rows known now{saved}")
    for group in groups:
        print(f"\n{group.name}:\n{HEADER}")
        print("\n".join(row(c, known, group.preds.get(c.name), world) for c in group.cases if c.name in group.ran))
        if group.walk:
            most = planner_longest(options, group.options.kit, world, heads, hw, precision, lengths[0])
            print(f"the planner's longest row that fits {hw.name}: {most:,} tokens (doubling from {lengths[0]:,})")


def _print_plan(groups: list[Group], options: Options, world: int, heads: int, lengths: list[int], hw,
                precision: str) -> None:
    """--plan-only: each group's rows with the planner's columns alone."""
    for group in groups:
        print(f"\n{group.name}:\n{HEADER}")
        print("\n".join(row(c, {}, group.preds.get(c.name), world) for c in group.cases))
        if group.walk:
            most = planner_longest(options, group.options.kit, world, heads, hw, precision, lengths[0])
            print(f"the planner's longest row that fits {hw.name}: {most:,} tokens (doubling from {lengths[0]:,})")


def plan_groups(args, options: Options, world: int, heads: int, lengths: list[int], hw,
                precision: str) -> list[Group]:
    """Each --cases group's cases (--only's), its kit and the planner's prediction of every case."""
    everything = {"sequence": sequence_cases(world, heads), "pipe": pipe_cases(world),
                  "longest": longest_cases(world, heads, lengths)}
    groups = []
    for name in args.cases:
        cases = [c for c in everything[name] if not args.only or c.name in args.only]
        if not cases:
            print(f"{name}: no case for {world} processes" + (" (pipe 2 x sequence 2 needs 4)" if name == "pipe"
                                                               else ""))
            continue
        walk = name == "longest"
        kit_name = "host+optimizer" if walk and args.kit == "auto" and hw.host_offload else args.kit
        kit = choose_kit(kit_name, cases, options, world, hw, precision)
        run_options = replace(options, kit=kit, steps=0 if walk and args.steps == 1 else args.steps)
        preds = {c.name: predict_case(c, run_options, kit, world, hw, precision) for c in cases}
        groups.append(Group(name, cases, run_options, preds))
        rows = "one row of each --lengths" if walk else f"{cases[0].rows} rows of {options.length:,} tokens"
        print(f"{name}: {rows} a step; pipezero's kit: {kit.label}", flush=True)
    return groups


if __name__ == "__main__":
    main()
