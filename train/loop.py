"""One training loop behind the three doors: the main job, `pipezero finetune`, `initialize`'s engine.

The rules the doors share live here once. An optimizer step steps the chain, then the LR
schedule only if the chain stepped (a step skipped for inf/nan gradients leaves the LR where it
is, as DeepSpeed's engine does), then clears the gradients: `optimizer_step`, which
`Engine.step` takes at each accumulation boundary. `train_loop` runs steps start+1 .. steps:
the schedule's forward and backward of every micro-batch, that optimizer step, the step's
numbers (TensorBoard / W&B scalars every step; a log line every steps_per_print steps, at the
first and at the last; wall_clock_breakdown's times), a held-out loss every eval_interval
steps and at the last, a checkpoint every save_interval steps and at the last (the two newest
kept), and SIGTERM / SIGUSR1 (train/preempt.py): every rank saves at the step boundary and
exits 0. What differs per door is a `Door`: how a batch is fetched and how many tokens it
holds, how a checkpoint is saved, and the door's own numbers (the main job's MFU and measured
timeline, finetune's data share).

    door = MyDoor(...)                                   # next_batch, tokens, save, numbers
    loss = train_loop(parts, door, HeldOut(val, 4, "val"), Cadence(steps, 50, 100, 10), start)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

from pipezero.chain import ChainLink
from pipezero.comm import TRAFFIC
from pipezero.precision import global_grad_norm
from pipezero.train.build import Parts
from pipezero.train.checkpoint import prune_checkpoints
from pipezero.train.config import TrainConfig
from pipezero.train.log import Phase, TensorBoardWriter, Timers, get_logger
from pipezero.train.metrics import peak_memory_bytes, traffic_scalars
from pipezero.train.preempt import Preemption

__all__ = ["Cadence", "Door", "EvalBatches", "HeldOut", "StepRecord", "evaluate", "open_writer",
           "optimizer_step", "step_and_schedule", "train_loop"]

KEEP_CHECKPOINTS = 2  # the newest checkpoints a job keeps under <out>/checkpoints
log = get_logger("loop")


# -- the optimizer step: one rule for every door ----------------------------------------------------

def step_and_schedule(optimizer: ChainLink, scheduler: LRScheduler | None) -> bool:
    """Step the optimizer chain, then the LR schedule only if the chain stepped: a step skipped for
    inf/nan gradients leaves the LR where it is (as DeepSpeed's engine). True when it stepped."""
    stepped = bool(optimizer.step())
    if stepped and scheduler is not None:
        scheduler.step()
    return stepped


def optimizer_step(optimizer: ChainLink, scheduler: LRScheduler | None) -> bool:
    """`step_and_schedule`, then clear the gradients: one optimizer step as every door takes it."""
    stepped = step_and_schedule(optimizer, scheduler)
    optimizer.zero_grad()
    return stepped


def _grad_norm(parts: Parts) -> float:
    """This step's global gradient norm: the loss scaler's when it clipped, else measured (a collective)."""
    if parts.config.gradient_clipping:
        return parts.scaler.last_grad_norm
    return float(global_grad_norm([p for g in parts.optimizer.param_groups for p in g["params"]]))


# -- what a door supplies -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One finished step: its number (1-based), loss, the LR it used, and its timing."""

    done: int
    loss: float
    lr: float
    stepped: bool          # False: skipped for inf/nan gradients (the LR schedule stayed)
    grad_norm: float
    seconds: float         # the whole step, the batch's fetch included
    data_seconds: float    # fetching the batch
    tokens_per_s: float    # over the whole job


class Door(Protocol):
    """What one door of the loop supplies (every rank calls each method at the same step)."""

    def next_batch(self) -> tuple[Any, Any]:
        """This rank's (inputs, targets) of the next step."""

    def tokens(self, inputs: Any) -> int:
        """The tokens one step trains over the whole job (tokens/s's numerator)."""

    def save(self, step: int, loss: float) -> Path:
        """Checkpoint `step` (a collective); the step's folder, whose parent the loop prunes."""

    def numbers(self, step: StepRecord, printing: bool) -> tuple[dict[str, float], list[str]]:
        """The door's own scalars and log-line fields for `step` (`printing`: a line is logged)."""


class EvalBatches(Protocol):
    """Held-out batches: restartable from their first one."""

    steps_per_epoch: int

    def next_batch(self) -> tuple[Any, Any]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The held-out loss: the mean over the first `count` batches of `batches`, logged as '<name> loss'."""

    batches: EvalBatches
    count: int
    name: str = "val"


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When the loop evaluates, saves and prints (1-based steps); the last step does all three."""

    steps: int                 # the last step
    eval_interval: int
    save_interval: int
    print_interval: int | None  # steps_per_print; None: the first and the last step only

    def evaluates(self, done: int) -> bool:
        return done % self.eval_interval == 0 or done == self.steps

    def saves(self, done: int) -> bool:
        return done % self.save_interval == 0 or done == self.steps

    def prints(self, done: int, start: int) -> bool:
        periodic = self.print_interval is not None and done % self.print_interval == 0
        return periodic or done in (start + 1, self.steps)


# -- the loop -------------------------------------------------------------------------------------

def open_writer(config: TrainConfig) -> TensorBoardWriter:
    """The job's scalar sink: TensorBoard under the config's tensorboard path, and W&B when configured."""
    return TensorBoardWriter(config.tensorboard.output_path, config.tensorboard.job_name, enabled=True,
                             wandb=config.wandb)


def train_loop(parts: Parts, door: Door, held_out: HeldOut, cadence: Cadence, start: int, *,
               save_on_signal: bool = True, writer: TensorBoardWriter | None = None) -> float:
    """Steps start+1 .. cadence.steps on every rank; returns the last step's loss (nan: none ran).

    `writer` (default: `open_writer(parts.config)`) is closed at the end, or before a preempted exit.
    """
    tb = writer if writer is not None else open_writer(parts.config)
    cuda = parts.device.type == "cuda"
    timers = Timers(enabled=parts.config.wall_clock_breakdown, sync=torch.cuda.synchronize if cuda else None)
    stop = Preemption(save_on_signal, parts.device)  # SIGTERM / SIGUSR1: save at a step boundary, exit 0
    loss = float("nan")
    for step in range(start, cadence.steps):
        record = _train_step(parts, door, timers, step + 1)
        loss = record.loss
        _show(parts, door, tb, timers, record, cadence.steps, cadence.prints(record.done, start))
        if cadence.evaluates(record.done):
            val_loss = evaluate(parts.runner, held_out.batches, held_out.count)
            tb.scalar("val/loss", val_loss, record.done)
            log.info("step %d | %s loss %.4f", record.done, held_out.name, val_loss)
        if stop.requested() or cadence.saves(record.done):
            saved = door.save(record.done, loss)
            if parts.grid.rank == 0:
                prune_checkpoints(saved.parent, keep=KEEP_CHECKPOINTS)
        stop.exit_if_requested(record.done, cadence.steps, close=tb.close)
    stop.restore()
    tb.close()
    return loss


def _train_step(parts: Parts, door: Door, timers: Timers, done: int) -> StepRecord:
    """Forward and backward of every micro-batch as the schedule orders them, then the optimizer step."""
    TRAFFIC.reset()
    t0 = time.perf_counter()
    inputs, targets = door.next_batch()
    t_data = time.perf_counter() - t0
    loss = parts.runner.train_step(inputs, targets)
    _time_actions(timers, parts.runner.timeline.events)

    # the optimizer chain: reduce (ZeRO), unscale/check/clip (LossScaler), the torch optimizer, gather
    with timers(Phase.OPTIMIZER):
        lr = parts.optimizer.param_groups[0]["lr"]  # the LR this step uses
        stepped = step_and_schedule(parts.optimizer, parts.scheduler)
        norm = _grad_norm(parts)                    # before the gradients are cleared
        parts.optimizer.zero_grad()
    seconds = time.perf_counter() - t0
    return StepRecord(done=done, loss=loss.item(), lr=lr, stepped=stepped, grad_norm=norm, seconds=seconds,
                      data_seconds=t_data, tokens_per_s=door.tokens(inputs) / seconds)


def _show(parts: Parts, door: Door, tb: TensorBoardWriter, timers: Timers, step: StepRecord, steps: int,
          printing: bool) -> None:
    """The step's scalars (every step) and its log line (when `printing`); every rank calls it."""
    scaler = parts.scaler
    traffic = traffic_scalars(TRAFFIC.snapshot())
    timers.add(Phase.COMMUNICATION, sum(v for k, v in traffic.items() if k.startswith("seconds/")))
    scalars = {"train/loss": step.loss, "train/lr": step.lr, "train/loss_scale": scaler.loss_scale,
               "train/skipped_steps": scaler.skipped_steps, "train/grad_norm": step.grad_norm,
               "perf/tokens_per_s": step.tokens_per_s, "perf/step_s": step.seconds,
               "memory/peak_bytes": peak_memory_bytes(parts.device),
               **{f"comm/{k}": v for k, v in traffic.items()}}
    extra, fields = door.numbers(step, printing)  # may be a collective (the measured bubble): every rank
    scalars.update(extra)
    if printing:
        log.info("step %d/%d | loss %.4f | lr %.2e | scale %g | grad norm %.3f | %.0f tok/s%s%s", step.done,
                 steps, step.loss, step.lr, scaler.loss_scale, step.grad_norm, step.tokens_per_s,
                 "".join(f" | {f}" for f in fields), "" if step.stepped else " | SKIPPED (inf/nan)")
        if timers.enabled:
            log.info("time: %s", timers.format())
    tb.scalars(scalars, step.done)


def _time_actions(timers: Timers, events: Any) -> None:
    """wall_clock_breakdown from the runner's own timeline: forward, backward (waiting on peers apart)."""
    if not timers.enabled:
        return
    for e in events:
        if e.kind != "comm":  # waiting on peers: TRAFFIC's seconds count it
            timers.add(Phase.FORWARD if "F" in e.name else Phase.BACKWARD, e.end - e.start)


@torch.no_grad()
def evaluate(runner: Any, batches: EvalBatches, count: int) -> float:
    """Mean loss over the first `count` held-out batches (the same ones every time; at least one)."""
    batches.load_state_dict({"epoch": 0, "step": 0})
    n = max(1, min(count, batches.steps_per_epoch))
    return sum(runner.eval_step(*batches.next_batch()).item() for _ in range(n)) / n
