"""The `pipezero` console command: simulate a schedule, or train the GPT example from a ds_config.

    pipezero simulate --schedule zbv --stages 4 --microbatches 8      # grid, bubble, peak memory, PNG
    pipezero train [CONFIG] [the main job's flags]                   # torchrun-style, or re-launched
    pipezero plan --layers 4 --d-model 128 --global-batch 32           # ranked layouts, winner's ds_config
    pipezero finetune --model DIR --data PATH [--config ds_config.json]  # pipezero/train/finetune.py

`train` runs the main job, pipezero.train.gpt.job (the package's own, so an installed wheel
runs it; examples/train_gpt.py is the same job as a script); without CONFIG it trains with the
flags' defaults. Under torchrun (RANK is set) it runs in this process; otherwise it re-launches
itself through torch.distributed.run with --nproc-per-node processes (default: the pipeline
stages x --data x --tensor x --sequence-parallel). Every parser comes from train/flags.py, which
imports no torch: `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pipezero.train.flags import (SCHEDULE_NAMES, DefaultsHelp, cost, finetune_parser, job_parser, parse_job_args,
                                  positive_int)
from pipezero.train.forward_signals import run_forwarding
from pipezero.train.plan.cli import add_plan_parser

__all__ = ["DefaultsHelp", "cost", "examples_dir", "launch", "main", "positive_int"]  # flags' helpers as before

def examples_dir() -> Path:
    """The repository's examples/ folder, or a FileNotFoundError that says how to get it.

    No command needs it any more (the main job and its model are in the package); kept for callers.
    """
    import pipezero

    root = Path(pipezero.__file__).resolve().parent
    folder = root / "examples"
    if not (folder / "train_gpt.py").is_file():
        raise FileNotFoundError(f"pipezero train needs examples/train_gpt.py, which is not next to the installed "
                                f"package ({root}); clone the repository and `pip install -e .` there, or run "
                                f"torchrun examples/train_gpt.py from the clone")
    return folder


# the simulator's work grows with stages x (stages x microbatches x chunks); past these it runs for minutes
MAX_SIM_STAGES = 1024
MAX_SIM_CHUNK_RUNS = 1 << 18
# past these the text grid is too wide or too long to read (the PNG still shows it)
MAX_TEXT_RANKS, MAX_TEXT_ROWS = 32, 2000


def _check_sim_size(args: argparse.Namespace) -> None:
    runs = args.stages * args.microbatches * (args.chunks or 1)
    if args.stages > MAX_SIM_STAGES or runs > MAX_SIM_CHUNK_RUNS:
        raise SystemExit(f"pipezero simulate: --stages {args.stages} x --microbatches {args.microbatches} x "
                         f"chunks {args.chunks or 1} is too large to simulate here (at most {MAX_SIM_STAGES} "
                         f"stages and {MAX_SIM_CHUNK_RUNS} stage x microbatch x chunk runs); pass fewer")


def _simulate(args: argparse.Namespace) -> int:
    from pipezero import pipe

    _check_sim_size(args)
    png = Path(args.png or f"{args.schedule}_p{args.stages}_m{args.microbatches}.png")
    try:
        schedule = pipe.make_schedule(args.schedule, args.microbatches, args.chunks)
        costs = pipe.Costs(forward=args.forward, backward_input=args.backward_input,
                           backward_weight=args.backward_weight)
        result = pipe.simulate(schedule, args.stages, costs=costs)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"pipezero simulate: {e}") from None
    text = pipe.to_text(result) if args.stages <= MAX_TEXT_RANKS else ""
    if text and text.count("\n") <= MAX_TEXT_ROWS:
        print(text)
    else:
        print(f"(the text grid of {args.stages} ranks over makespan {result.makespan:g} is too large to print; "
              f"the PNG shows it)")
    peaks = sorted(result.peak_stage_activations().items())
    if len(peaks) <= MAX_TEXT_RANKS:
        peak = ", ".join(f"rank {r}: {n:g}" for r, n in peaks)
    else:
        top = max(peaks, key=lambda rn: rn[1])
        peak = f"at most {top[1]:g} (rank {top[0]}), at least {min(n for _, n in peaks):g}"
    print(f"\n{schedule!r}: {args.stages} stages, {args.microbatches} microbatches, "
          f"makespan {result.makespan:g}, bubble {result.bubble:.3f}")
    print(f"peak live activations (whole-stage microbatches): {peak}")
    try:
        pipe.to_png(result, png)
    except OSError as e:
        raise SystemExit(f"pipezero simulate: cannot write --png {str(png)!r}: {e.strerror or e}; "
                         "pass --png in a folder that exists and is writable") from None
    print(f"wrote {png}")
    return 0


_LAUNCHER = ("--nproc-per-node", "--max-restarts")  # pipezero train's own flags, not the job's


def _train_parser() -> argparse.ArgumentParser:
    """The main job's flags and the launcher's: `pipezero train --help` shows them all, with defaults."""
    p = job_parser("pipezero train")
    p.allow_abbrev = False  # a launcher flag is told apart from the job's by its full name
    launch = p.add_argument_group("launcher (without torchrun's RANK set)")
    launch.add_argument("--nproc-per-node", type=positive_int, default=None,
                        help="processes to start (default: the pipeline stages x --data)")
    launch.add_argument("--max-restarts", type=int, default=0, help="torchrun's restarts after a failure")
    return p


def _job_argv(rest: list[str]) -> list[str]:
    """The command line without the launcher's flags: what each of torchrun's processes reads."""
    out, skip = [], False
    for token in rest:
        if skip:
            skip = False
        elif token in _LAUNCHER:
            skip = True
        elif not token.startswith(tuple(f"{flag}=" for flag in _LAUNCHER)):
            out.append(token)
    return out


def _nproc(args: argparse.Namespace) -> int:
    """Pipeline stages (flag, else config, else 2) x data degree (--data flag, else 1) x expert (flag, else
    config's expert_parallel autoep_size, else 1) x tensor x sequence (flag, else config's
    sequence_parallel_size, else 1)."""
    config = json.loads(Path(args.config).read_text()) if args.config else {}
    stages = args.pipe if args.pipe is not None else config.get("pipeline", {}).get("stages", 2)
    sequence = args.sequence_parallel or config.get("sequence_parallel_size", 1)
    section = config.get("expert_parallel") or {}
    expert = args.expert_parallel or (section.get("autoep_size", 1) if section.get("enabled") else 1)
    return stages * (args.data or 1) * expert * args.tensor * sequence


def _train(rest: list[str]) -> int:
    parser = _train_parser()
    args = parse_job_args(rest, parser)  # bad flags and --help end here, before torch loads
    if args.config is not None and not Path(args.config).is_file():
        raise SystemExit(f"pipezero train: config {args.config!r} is not a file")
    argv = _job_argv(rest)
    if "RANK" in os.environ:  # already under torchrun: one of its workers
        from pipezero.train.gpt.job import run

        run(argv)
        return 0
    nproc = args.nproc_per_node or _nproc(args)
    return launch("pipezero.train.gpt.job", argv, nproc, "pipezero train", args.max_restarts)


def launch(module: str, argv: list[str], nproc: int, prog: str, max_restarts: int = 0) -> int:
    """Run `python -m module argv` as `nproc` processes of one host through torch.distributed.run
    (torchrun --standalone); the exit status. For a command started outside torchrun (no RANK)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", module, *argv]
    print(f"{prog}: " + " ".join(cmd), file=sys.stderr)
    return run_forwarding(cmd)  # SIGTERM / SIGUSR1 here go on to the workers: they save and exit 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipezero", description="pipeline-parallel training toolkit")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="simulate a schedule: text grid, bubble, peak memory, PNG",
                         formatter_class=DefaultsHelp)
    sim.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b", help="the schedule to simulate")
    sim.add_argument("--stages", type=positive_int, default=4, help="pipeline stages (ranks)")
    sim.add_argument("--microbatches", type=positive_int, default=8, help="micro-batches per step")
    sim.add_argument("--chunks", type=positive_int, default=None,
                     help="virtual chunks per rank (default: the schedule's; interleaved_1f1b takes any >= 2)")
    sim.add_argument("--forward", type=cost, default=1.0, help="cost of F")
    sim.add_argument("--backward-input", type=cost, default=1.0, help="cost of I (B = I + W)")
    sim.add_argument("--backward-weight", type=cost, default=1.0, help="cost of W")
    sim.add_argument("--png", default=None, help="where to write the picture")
    add_plan_parser(sub, DefaultsHelp)
    sub.add_parser("train", add_help=False, help="train the main job's GPT; pipezero train --help shows its flags")
    sub.add_parser("finetune", add_help=False, help="fine-tune --model DIR on --data PATH (pipezero.train.finetune)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pipezero` command."""
    args, rest = _parser().parse_known_args(argv)
    if args.command == "simulate":
        if rest:
            raise SystemExit(f"pipezero simulate: unknown arguments {rest}")
        return _simulate(args)
    if args.command == "plan":
        if rest:
            raise SystemExit(f"pipezero plan: unknown arguments {rest}")
        from pipezero.train.plan.cli import run_plan

        return run_plan(args)
    if args.command == "finetune":  # in this process, or each of torchrun's
        finetune_parser().parse_args(rest)  # bad flags and --help end here, before torch loads
        from pipezero.train.finetune import run as finetune
        finetune(rest)
        return 0
    return _train(rest)


if __name__ == "__main__":
    sys.exit(main())
