"""The `pipezero` console command: simulate a schedule, or train the GPT example from a ds_config.

    pipezero simulate --schedule zbv --stages 4 --microbatches 8      # grid, bubble, peak memory, PNG
    pipezero train CONFIG [train_gpt.py flags]                        # torchrun-style, or re-launched
    pipezero plan --layers 4 --d-model 128 --global-batch 32           # ranked layouts, winner's ds_config
    pipezero finetune --model DIR --data PATH [--config ds_config.json]  # pipezero/train/finetune.py

`train` runs the main job, pipezero.train.gpt.job (the package's own, so an installed wheel
runs it; examples/train_gpt.py is the same job as a script). Under torchrun (RANK is set) it
runs in this process; otherwise it re-launches itself through torch.distributed.run with
--nproc-per-node processes (default: the pipeline stages x --data).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["DefaultsHelp", "cost", "examples_dir", "launch", "main", "positive_int"]


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default; a flag whose default is None says in its own help what applies."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)

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


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the ValueError into a one-line usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (expected >= 1)")
    return value


def cost(text: str) -> float:
    """argparse type: a finite number >= 0 (a cost in the simulator's time units)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def _nproc(config: str, rest: list[str]) -> int:
    """Pipeline stages (flag, else config, else 2) x data degree (--data flag, else 1)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--pipe", type=int)
    flags.add_argument("--data", type=int, default=1)
    known, _ = flags.parse_known_args(rest)
    stages = known.pipe
    if stages is None:
        stages = json.loads(Path(config).read_text()).get("pipeline", {}).get("stages", 2)
    return stages * known.data


def launch(module: str, argv: list[str], nproc: int, prog: str, max_restarts: int = 0) -> int:
    """Run `python -m module argv` as `nproc` processes of one host through torch.distributed.run
    (torchrun --standalone); the exit status. For a command started outside torchrun (no RANK)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", module, *argv]
    print(f"{prog}: " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)


def _train(args: argparse.Namespace, rest: list[str]) -> int:
    if not Path(args.config).is_file():
        raise SystemExit(f"pipezero train: config {args.config!r} is not a file")
    argv = ["--config", args.config, *rest]
    if "RANK" in os.environ:  # already under torchrun: one of its workers
        from pipezero.train.gpt.job import run

        run(argv)
        return 0
    nproc = args.nproc_per_node or _nproc(args.config, rest)
    return launch("pipezero.train.gpt.job", argv, nproc, "pipezero train", args.max_restarts)


def _parser() -> argparse.ArgumentParser:
    from pipezero.pipe.schedule.registry import schedule_names

    parser = argparse.ArgumentParser(prog="pipezero", description="pipeline-parallel training toolkit")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="simulate a schedule: text grid, bubble, peak memory, PNG",
                         formatter_class=DefaultsHelp)
    sim.add_argument("--schedule", choices=schedule_names(), default="1f1b")
    sim.add_argument("--stages", type=positive_int, default=4)
    sim.add_argument("--microbatches", type=positive_int, default=8)
    sim.add_argument("--chunks", type=positive_int, default=None,
                     help="virtual chunks per rank (default: the schedule's; interleaved_1f1b takes any >= 2)")
    sim.add_argument("--forward", type=cost, default=1.0, help="cost of F")
    sim.add_argument("--backward-input", type=cost, default=1.0, help="cost of I (B = I + W)")
    sim.add_argument("--backward-weight", type=cost, default=1.0, help="cost of W")
    sim.add_argument("--png", default=None, help="where to write the picture")
    from pipezero.train.plan.cli import add_plan_parser

    add_plan_parser(sub, DefaultsHelp)
    train = sub.add_parser("train", help="train the main job's GPT (examples/train_gpt.py's flags) with a ds_config")
    train.add_argument("config")
    train.add_argument("--nproc-per-node", type=int, default=None)
    train.add_argument("--max-restarts", type=int, default=0)
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
    if args.command == "finetune":  # in this process, torchrun's processes, or launching them (--nproc)
        from pipezero.train.finetune import run as finetune
        finetune(rest)
        return 0
    return _train(args, rest)


if __name__ == "__main__":
    sys.exit(main())
