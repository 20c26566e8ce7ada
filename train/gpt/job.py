"""The main job: train the small GPT (model.py) with a pipeline, ZeRO and mixed precision, top to bottom.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py            # pipe 2 x data 2, CPU or GPU
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --schedule zbv --zero-stage 1
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --pipe 2 --data 2 --tensor 2   # 3D
    sbatch examples/slurm/train_gpt.sbatch                                    # Slurm, one agent per node
    tensorboard --logdir runs/gpt

It ships in the package, so `pipezero train` runs it from an installed wheel; examples/train_gpt.py
is the same job as a script (it calls `main`). `main` builds the README's four parts by hand: a Grid, a PipelineModule of the GPT's layer
specs, the optimizer chain ZeroOptimizer(LossScaler(AdamW)) and a PipelineRunner, and the loop
(train/loop.py's, the one finetune and initialize's engine share; this job's `GptDoor` adds its MFU and
timeline) talks to them directly; nothing hides behind an engine. Their settings come from one ds_config:
the flags, on top of --config's file when given (pipezero.train.build makes the same parts from
a config in one call). The corpus is the standard library's own source code (byte tokens, on
every machine with Python), or --data-path. Re-running with the same --out resumes from the
latest checkpoint there (so does a torchrun --max-restarts restart after a crash), and a run
stopped after its last checkpoint writes its export then; --out is one job's (a second job
there is refused, naming the first one's pid and host: train/run_dir.py);
--resume-from step_00000100 resumes from that one instead. A bad input ends with its cause in
one line per failing rank (PIPEZERO_TRACEBACK=1 prints the traceback too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import torch

from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
from pipezero.pipe import simulate, to_image, to_png, to_text
from pipezero.pipe.float8 import Float8Config
from pipezero.pipe.schedule.timeline import chrome_trace, gather_events
from pipezero.precision import LossScaler
from pipezero.topology import Grid, process_device
from pipezero.train import Parts, build_optimizer, build_scheduler, loop, parse_config
from pipezero.train.checkpoint import step_dir_name
from pipezero.train.config import TrainConfig
from pipezero.train.config.batch import BatchConfig, keep_global_batch
from pipezero.train.config.recompute import apply_recompute_flags
from pipezero.train.data import ShardedBatches, TokenData
from pipezero.train.failure import run_as_command
from pipezero.train.flags import layout_section, parse_job_args
from pipezero.train.gpt.model import GPTConfig, flops_per_token, gpt_loss, gpt_specs, gpt_tensor_plan
from pipezero.train.log import Progress, TensorBoardWriter, get_logger, warn_once
from pipezero.train.loop import Cadence, HeldOut, StepRecord, open_writer
from pipezero.train.metrics import mfu, timeline_result
from pipezero.train.run_dir import claim_run_dir, export_done, record_loss, recorded_loss
from pipezero.train.checkpoint.resume import ResumePoint, point_batch, resume_from_point, resume_point
from pipezero.train.checkpoint.state import export_model, save_state
from pipezero.zero import ZeroOptimizer

__all__ = ["ds_config", "main", "parse_args", "resume", "run", "train_config"]

PEAK_FLOPS = {torch.float32: 67e12, torch.bfloat16: 989e12, torch.float16: 989e12}  # H100/H200 SXM, dense
log = logging.getLogger("pipezero.train_gpt")  # main's get_logger adds the rank prefix (rank 0 prints)


def main(argv: list[str] | None = None) -> float:
    """The whole job: config, the four parts, data, resume, the loop, the export; returns the last loss."""
    args = parse_args(argv)
    get_logger("train_gpt")  # installs the rank-aware handler: rank 0 prints, "[rank 0]" in front
    gpt = gpt_config(args)
    ckpt_dir = Path(args.out) / "checkpoints"
    point = resume_point(ckpt_dir, args.resume_from)  # the latest, or --resume-from's: read before and after
    saved = point_batch(point)  # resumed on another data degree (an elastic restart): keep its global batch
    cfg = train_config(args, saved)

    # -- the four parts, by hand: Grid, PipelineModule, ZeroOptimizer(LossScaler(AdamW)), PipelineRunner ---
    grid = Grid(pipe=cfg.pipeline.stages, data=None, tensor=args.tensor, sequence=cfg.sequence)  # the process group
    device = process_device()  # the GPU this rank's LOCAL_RANK names (nccl), else the CPU
    schedule = make_schedule(cfg.pipeline.schedule, cfg.batch.accumulation_steps, cfg.pipeline.chunks)
    model = PipelineModule(gpt_specs(gpt), grid, loss_fn=gpt_loss, num_chunks=cfg.pipeline.chunks,
                           placement=schedule.placement, partition_method=cfg.pipeline.partition_method,
                           recompute=cfg.recompute,
                           device=device, tensor_plan=gpt_tensor_plan(),
                           float8=Float8Config(recipe=args.float8) if args.float8 else None).to(cfg.compute_dtype)
    if cfg.recompute.enabled:
        log.info("activation checkpointing: %s", cfg.recompute.describe())
    adamw = build_optimizer(cfg.optimizer, model.parameters())     # torch AdamW: the config's lr, betas, decay
    scaler = LossScaler.from_config(adamw, cfg.precision.scaler)   # fp16 loss scale, inf/nan skips, clipping
    opt = ZeroOptimizer(scaler, group=grid.data_sequence_group, config=cfg.zero,
                        module=model if cfg.zero.stage == 3 else None)  # stage 3 also partitions the weights
    runner = PipelineRunner(model, schedule, optimizer=opt, timeout_s=cfg.pipeline.timeout,
                            reshard_after_forward=cfg.pipeline.reshard_after_forward)
    parts = Parts(config=cfg, grid=grid, module=model, optimizer=opt, scaler=scaler, inner=adamw,
                  scheduler=build_scheduler(cfg.scheduler, adamw), schedule=schedule, runner=runner,
                  dtype=cfg.compute_dtype, device=device)
    check_layout(args, parts, saved)

    # -- data, resume, train, export ------------------------------------------------------------------
    train, val = token_batches(args, cfg.batch.per_rank_batch_size, grid)
    with claim_run_dir(args.out, grid):  # one job per --out: another job's pid and host in the error
        start = resume_step(args, parts, point, train)
        if start >= args.steps:
            return finish_export(args, gpt, grid, start)
        loss = train_loop(args, parts, gpt, train, val, start)
        if grid.rank == 0 and (ckpt_dir / "latest").exists():
            export(args, gpt, start, loss)
        return loss


# -- the command line and the ds_config it makes -------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (train/flags.py, read without torch for --help); they override --config's keys."""
    return parse_job_args(argv)


def ds_config(args: argparse.Namespace) -> dict:
    """The ds_config this run uses: --config (if any) with the command line's choices on top."""
    cfg = json.loads(Path(args.config).read_text()) if args.config else {}
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if args.batch_size is not None or args.micro_batches is not None or \
            all(cfg.get(k, "auto") == "auto" for k in batch_keys):
        for key in batch_keys:
            cfg.pop(key, None)
        cfg["train_micro_batch_size_per_gpu"] = 4 if args.batch_size is None else args.batch_size
        cfg["gradient_accumulation_steps"] = 4 if args.micro_batches is None else args.micro_batches
        cfg.get("pipeline", {}).pop("micro_batches", None)
    layout_section(cfg, args, stages=2, zero_stage=2)  # the flags train/flags.py shares with finetune
    pipeline = cfg["pipeline"]
    if args.schedule is not None and args.chunks is None:
        pipeline.pop("chunks", None)  # a new schedule brings its own default chunk count
    pipeline.update({k: v for k, v in (("chunks", args.chunks), ("timeout", args.pipeline_timeout)) if v is not None})
    apply_recompute_flags(cfg, args)
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1,
                                                           "betas": [0.9, 0.95]}})
    cfg.setdefault("scheduler", {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": max(1, args.steps // 20), "total_num_steps": args.steps, "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.1}})
    if args.steps_per_print:
        cfg["steps_per_print"] = args.steps_per_print
    cfg.setdefault("steps_per_print", 10)
    return cfg


def auto_values(args: argparse.Namespace) -> dict:
    """What this script knows for a Hugging Face-style config's "auto" values (by DeepSpeed key path)."""
    return {"optimizer.params.lr": args.lr, "optimizer.params.weight_decay": 0.1,
            "optimizer.params.betas": [0.9, 0.95], "optimizer.params.eps": 1e-8, "gradient_clipping": 1.0,
            "scheduler.params.warmup_num_steps": max(1, args.steps // 20),
            "scheduler.params.total_num_steps": args.steps,
            "fp16.enabled": args.precision == "fp16", "bf16.enabled": args.precision == "bf16"}


def train_config(args: argparse.Namespace, saved: BatchConfig | None) -> TrainConfig:
    """The checked ds_config; resumed on another data degree, it keeps the checkpoint's global batch."""
    raw = ds_config(args)
    if "WORLD_SIZE" not in os.environ and raw["pipeline"]["stages"] > 1:
        raise ValueError(f"{raw['pipeline']['stages']} pipeline stages need as many processes at least, but this "
                         f"is one plain python process: launch torchrun --standalone --nproc-per-node 4 "
                         f"examples/train_gpt.py, or pass --pipe 1 to train in this process")
    cfg = parse_config(raw, tensor=args.tensor, hidden_size=args.d_model, auto_values=auto_values(args))
    if cfg.expert > 1:
        raise ValueError(f"expert parallelism {cfg.expert} (--expert-parallel, ds_config expert_parallel): "
                         "the GPT this job trains has no experts; use 1, or train a MoE model through "
                         "build(specs=hf_layer_specs(...)) (README, Mixture-of-experts)")
    return dataclasses.replace(cfg, batch=keep_global_batch(cfg.batch, saved))


def check_layout(args: argparse.Namespace, parts: Parts, saved: BatchConfig | None) -> None:
    """--data against the grid torchrun gave, the parts in the log, --expect-device, a changed data degree."""
    grid, batch = parts.grid, parts.config.batch
    if args.data is not None and args.data != grid.data_size:
        others = grid.pipe_size * grid.tensor_size * grid.sequence_size
        raise ValueError(f"--data {args.data} but {grid.world_size} processes / (pipe {grid.pipe_size} x tensor "
                         f"{grid.tensor_size} x sequence {grid.sequence_size}) give {grid.data_size}: launch "
                         f"torchrun --nproc-per-node {others * args.data}")
    log.info("grid %s, optimizer %s, schedule %s, %s on %s\n%s", grid, parts.optimizer, parts.schedule,
             str(parts.dtype).removeprefix("torch."), parts.device, parts.module.describe())
    if args.expect_device:
        _check_device(parts.module, args.expect_device, grid.rank)
    if saved is not None and saved.data_degree != grid.data_size:
        log.info("data degree %d, the checkpoint's %d: %d accumulation steps (it had %d) keep its global batch of %d",
                 grid.data_size, saved.data_degree, batch.accumulation_steps, saved.accumulation_steps,
                 batch.train_batch_size)


def token_batches(args: argparse.Namespace, per_rank: int, grid: Grid) -> tuple[ShardedBatches, ShardedBatches]:
    """Byte tokens of --data-path (else the stdlib sources): this data rank's share of every global batch
    (by data x expert rank: with an expert axis, each of those ranks reads its own rows)."""
    data = TokenData.from_file(args.data_path, args.seq_len) if args.data_path else TokenData.stdlib(args.seq_len)
    slices = dict(sequence_rank=grid.sequence_rank, sequence_degree=grid.sequence_size)  # pipe/sequence/
    rows = grid.data_expert_rank, grid.data_expert_size
    train = ShardedBatches(data, per_rank, *rows, split="train", **slices)
    val = ShardedBatches(data, per_rank, *rows, split="val", shuffle=False, **slices)
    return train, val


# -- checkpoints ----------------------------------------------------------------------------------------

def resume_step(args: argparse.Namespace, parts: Parts, point: ResumePoint | None, train: ShardedBatches) -> int:
    """The step to start from: 0, or the resumed checkpoint's (its data position restored into `train`)."""
    meta = resume_from_point(parts, point, dataclasses.asdict(gpt_config(args)))
    if args.resume and meta is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {Path(args.out) / 'checkpoints'}; drop --resume "
                                "to start fresh")
    if meta is None:
        return 0
    train.load_state_dict(meta["data"])
    log.info("resumed from %s at step %d", meta["path"], meta["step"])
    return meta["step"]


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The model the shape flags describe (recorded in every checkpoint, checked on resume)."""
    return GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq_len)


def resume(parts, ckpt_dir: Path, resume_from: str | None, gpt: dict | None = None) -> dict | None:
    """The latest checkpoint's meta (None: start fresh), or that of --resume-from's step."""
    return resume_from_point(parts, resume_point(ckpt_dir, resume_from), gpt)


def save(args: argparse.Namespace, parts: Parts, step: int, train: ShardedBatches, loss: float) -> Path:
    """A checkpoint of this step under --out/checkpoints (the loop keeps the two newest); its folder."""
    ckpt_dir = Path(args.out) / "checkpoints"
    saved = save_state(parts, ckpt_dir, step, train.state_dict(), model_config=dataclasses.asdict(gpt_config(args)))
    log.info("step %d | saved checkpoint %s", step, ckpt_dir / step_dir_name(step))
    if parts.grid.rank == 0:
        record_loss(args.out, step, loss)
    return saved


def export(args: argparse.Namespace, gpt: GPTConfig, start: int, loss: float) -> None:
    """model.safetensors (with its GPTConfig in the header) and summary.json, from the latest checkpoint."""
    path = export_model(Path(args.out) / "checkpoints", Path(args.out) / "model.safetensors", gpt_specs(gpt),
                        metadata={"gpt_config": json.dumps(dataclasses.asdict(gpt))})
    # the module, not examples/generate.py: an installed wheel has no examples/ folder
    log.info("exported %s (sample from it: python -m pipezero.train.gpt.generate --checkpoint %s)", path, args.out)
    summary = {"steps": args.steps, "resumed_from": start, "final_loss": loss}
    (Path(args.out) / "summary.json").write_text(json.dumps(summary))


def finish_export(args: argparse.Namespace, gpt: GPTConfig, grid: Grid, step: int) -> float:
    """A run already trained to its last step: its export, written now if the job stopped before it."""
    if export_done(args.out, step):
        log.info("the run in %s is already complete (step %d of --steps %d): nothing to train; pass --steps "
                 "above %d to train longer, or another --out to start afresh", args.out, step, args.steps, step)
        return _summary_loss(args.out)
    log.info("the run in %s trained to step %d but its export is missing or damaged (the job stopped before "
             "it, or the file was changed): exporting it now", args.out, step)
    loss = recorded_loss(args.out, step)
    loss = float("nan") if loss is None else loss
    if grid.rank == 0:
        export(argparse.Namespace(**{**vars(args), "steps": step}), gpt, step, loss)  # the step it holds
    return loss


def _summary_loss(out: str) -> float:
    """The final loss a finished run recorded (NaN when it recorded none)."""
    path = Path(out) / "summary.json"
    return json.loads(path.read_text())["final_loss"] if path.is_file() else float("nan")


# -- the loop: train/loop.py's, with the main job's door ---------------------------------------------------

def train_loop(args: argparse.Namespace, parts: Parts, gpt: GPTConfig, train: ShardedBatches,
               val: ShardedBatches, start: int) -> float:
    """Steps start+1 .. --steps through the one loop (train/loop.py); the simulated timeline drawn first."""
    tb = open_writer(parts.config)
    sim = simulate(parts.schedule, parts.grid.pipe_size)
    _picture(tb, "pipeline/simulated", sim, start, args.out)
    log.info("schedule (simulated bubble %.3f):\n%s", sim.bubble, to_text(sim))
    door = GptDoor(args, parts, gpt, train, tb, Progress(args.steps, desc="train", start=start), start)
    cadence = Cadence(args.steps, args.eval_interval, args.save_interval, parts.config.steps_per_print)
    return loop.train_loop(parts, door, HeldOut(val, 4, "val"), cadence, start, save_on_signal=args.save_on_signal,
                           writer=tb)


@dataclasses.dataclass
class GptDoor:
    """The main job's side of the loop: its batches and checkpoints, MFU, the measured bubble and timeline
    pictures (the first and the last step), the progress bar."""

    args: argparse.Namespace
    parts: Parts
    gpt: GPTConfig
    train: ShardedBatches
    tb: TensorBoardWriter
    progress: Progress
    start: int

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train.next_batch()

    def tokens(self, inputs: torch.Tensor) -> int:
        return self.parts.config.batch.train_batch_size * self.args.seq_len

    def save(self, step: int, loss: float) -> Path:
        return save(self.args, self.parts, step, self.train, loss)

    def numbers(self, step: StepRecord, printing: bool) -> tuple[dict[str, float], list[str]]:
        parts, scalars, fields = self.parts, {}, []
        peak = PEAK_FLOPS.get(parts.dtype) if parts.device.type == "cuda" else None
        util = mfu(step.tokens_per_s, flops_per_token(self.gpt), parts.grid.world_size, peak)
        if util is not None:
            scalars["perf/mfu"] = util
            fields.append(f"MFU {util:.1%}")
        if printing:
            bubble = scalars["pipeline/measured_bubble"] = parts.runner.measured_bubble()  # a collective
            if step.done in (self.start + 1, self.args.steps):  # the first and the last step draw their timeline
                _timeline_picture(self.tb, parts, self.args.out, step.done)
            fields.append(f"bubble {bubble:.2f}")
        self.progress.update(loss=step.loss)
        return scalars, fields


def _timeline_picture(tb: TensorBoardWriter, parts: Parts, out: str, step: int) -> None:
    """The measured timeline of this step: a TensorBoard image and a chrome trace (every pipe rank joins)."""
    grid = parts.grid
    events = gather_events(parts.runner.timeline.events, grid.pipe_group)
    if grid.data_rank == 0 and grid.rank == 0:
        result = timeline_result(events, lambda r: grid.coords(r).pipe, grid.pipe_size, parts.module.num_chunks)
        _picture(tb, "pipeline/measured", result, step, out)
        chrome_trace(events, os.path.join(out, f"timeline_step{step}.json"))


def _picture(tb: TensorBoardWriter, tag: str, result, step: int, out: str) -> None:
    """A timeline as a PNG file beside the logs, and as a TensorBoard image when pillow is installed."""
    if not tb.active:
        return
    to_png(result, os.path.join(out, f"{tag.replace('/', '_')}_step{step}.png"))
    try:
        tb.image(tag, to_image(result), step)
    except ImportError:
        warn_once("pillow is not installed: timeline images are PNG files in %s, not in TensorBoard", out, logger=log)


def _check_device(module: PipelineModule, expect: str, rank: int) -> None:
    """--expect-device: every parameter now, and each chunk's first output (an activation), on `expect`.

    A smoke for GPU runs: a job that silently trains on the CPU still converges, only slowly.
    """
    wrong = [n for n, p in module.named_parameters() if p.device.type != expect]
    if wrong:
        raise RuntimeError(f"rank {rank}: --expect-device {expect}, but {len(wrong)} parameters are elsewhere, "
                           f"e.g. {wrong[0]} on {dict(module.named_parameters())[wrong[0]].device}")
    print(f"[rank {rank}] device check: {sum(1 for _ in module.parameters())} parameters on "
          f"{next(module.parameters()).device}", file=sys.stderr, flush=True)
    seen: set[int] = set()

    def hook(mod, args, kwargs, out) -> None:
        chunk = kwargs.get("chunk", 0)
        if chunk in seen:
            return
        seen.add(chunk)
        act = out if isinstance(out, torch.Tensor) else out[0]
        if act.device.type != expect:
            raise RuntimeError(f"rank {rank}: --expect-device {expect}, but chunk {chunk}'s activation is on "
                               f"{act.device}")
        print(f"[rank {rank}] device check: chunk {chunk} activation {tuple(act.shape)} on {act.device}",
              file=sys.stderr, flush=True)
        if len(seen) == mod.num_chunks:
            handle.remove()

    handle = module.register_forward_hook(hook, with_kwargs=True)


def run(argv: list[str] | None = None) -> float:
    """main() as a command: a known cause of failure ends the process with one line per failing rank."""
    return run_as_command(main, argv, "train_gpt.py")


if __name__ == "__main__":
    run()
