"""Rank-aware logging, TensorBoard, a progress bar and wall-clock timers for training runs.

Every rank of a job runs the same code, so unfiltered logging prints each line N times.
Here the `pipezero` logger has one handler that prefixes the rank and, by default, lets only
rank 0 through; `set_log_ranks(None)` shows every rank. `warn_once` is pipezero's one
warn-once helper (it lives in pipezero.config_fields, the bottom layer, for the config readers);
`warn_once(msg, logger=get_logger())` goes through that handler. The TensorBoard writer exists
on one rank and is a no-op elsewhere, so call sites need no `if rank == 0`; given ds_config's
`wandb` section it writes every scalar to Weights & Biases too (train/wandb_sink.py), the one place
scalars leave a job.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TextIO

import torch

from pipezero.config_fields import warn_once

if TYPE_CHECKING:
    from pipezero.train.config.monitor import WandbConfig

__all__ = ["Phase", "Progress", "TensorBoardWriter", "Timers", "current_rank", "get_logger",
           "set_log_ranks", "warn_once"]

_ROOT = "pipezero"
_FORMAT = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s"


def current_rank() -> int:
    """This process's global rank: the process group's if initialised, else torchrun's RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    """Stamps record.rank and drops records from ranks that should stay quiet."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks: frozenset[int] | None = frozenset({0})

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return self.ranks is None or record.rank in self.ranks


_FILTER = _RankFilter()


def _install_handler() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not any(getattr(h, "_pipezero", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._pipezero = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_FILTER)
        root.addHandler(handler)
        root.propagate = False
        if root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
    return root


def get_logger(name: str = "") -> logging.Logger:
    """The `pipezero[.name]` logger; use lazy %s arguments: log.info("step %s loss %s", i, x)."""
    _install_handler()
    return logging.getLogger(f"{_ROOT}.{name}" if name else _ROOT)


def set_log_ranks(ranks: Iterable[int] | None = (0,)) -> None:
    """Which global ranks print (default rank 0 only); None lets every rank print."""
    _FILTER.ranks = None if ranks is None else frozenset(ranks)


class TensorBoardWriter:
    """One SummaryWriter at `output_path/job_name` on `writer_rank`; every method is a no-op elsewhere.

    With an enabled `wandb` config the same rank also opens a W&B run and every scalar goes to
    both. Images need pillow (torch's add_image encodes PNG with it); they go to TensorBoard only.
    """

    def __init__(self, output_path: str, job_name: str, enabled: bool = True,
                 writer_rank: int = 0, rank: int | None = None, wandb: WandbConfig | None = None):
        rank = current_rank() if rank is None else rank
        self.log_dir = os.path.join(output_path, job_name)
        self._writer = None
        self._wandb = None
        if enabled and rank == writer_rank:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        if wandb is not None and wandb.enabled and rank == writer_rank:
            from pipezero.train.wandb_sink import WandbSink

            self._wandb = WandbSink(wandb, output_path)

    @property
    def active(self) -> bool:
        """Whether this rank writes."""
        return self._writer is not None

    def scalar(self, tag: str, value: float | torch.Tensor, step: int) -> None:
        """One scalar point."""
        self.scalars({tag: value}, step)

    def scalars(self, values: Mapping[str, float | torch.Tensor], step: int, prefix: str = "") -> None:
        """Many scalars at once, each tagged prefix + key: TensorBoard's points and one W&B row."""
        if self._writer is None and self._wandb is None:
            return  # not the writing rank: no float() of a device tensor here
        points = {prefix + tag: float(value) for tag, value in values.items()}
        if self._writer is not None:
            for tag, value in points.items():
                self._writer.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(points, step)

    def image(self, tag: str, image: torch.Tensor | Any, step: int) -> None:
        """An image: CHW float in [0, 1], or HWC uint8 (tensor or numpy, e.g. pipe.to_image's timeline)."""
        if self._writer is None:
            return
        if not isinstance(image, torch.Tensor):
            image = torch.as_tensor(image)
        if image.dtype == torch.uint8:
            self._writer.add_image(tag, image, step, dataformats="HWC")
        else:
            self._writer.add_image(tag, image.clamp(0, 1), step, dataformats="CHW")

    def flush(self) -> None:
        """Write pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; finish the W&B run."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> "TensorBoardWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Progress:
    """A plain-text progress bar on one rank: redrawn in place on a terminal, a line per ~5% otherwise."""

    def __init__(self, total: int, desc: str = "", enabled: bool | None = None,
                 stream: TextIO | None = None, width: int = 24, start: int = 0):
        """`start`: steps already done (a resumed run counts on from there, like its log)."""
        self.total, self.desc, self.width = max(1, total), desc, width
        self.count = self._start_count = min(max(0, start), self.total)
        self.enabled = current_rank() == 0 if enabled is None else enabled
        self.stream = stream or sys.stderr
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._every = max(1, self.total // 20)
        self._start = time.perf_counter()

    def update(self, n: int = 1, **postfix: float | str) -> None:
        """Advance by n and show key=value pairs (e.g. loss=2.31) after the bar."""
        self.count = min(self.total, self.count + n)
        if self.enabled and (self._tty or self.count % self._every == 0 or self.count == self.total):
            end = "\r" if self._tty and self.count < self.total else "\n"
            self.stream.write(self.render(**postfix) + end)
            self.stream.flush()

    def render(self, **postfix: float | str) -> str:
        """The bar as text: desc [#####.....] 12/100 3.1 it/s loss=2.31."""
        filled = self.width * self.count // self.total
        rate = (self.count - self._start_count) / max(1e-9, time.perf_counter() - self._start)
        extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
        bar = "#" * filled + "." * (self.width - filled)
        return f"{self.desc} [{bar}] {self.count}/{self.total} {rate:.2f} it/s {extra}".strip()


class Phase(enum.Enum):
    """The phases wall_clock_breakdown reports."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    COMMUNICATION = "communication"


class Timers:
    """Accumulating wall-clock timers per Phase; disabled timers cost one branch.

    On GPU pass `sync=torch.cuda.synchronize` so a phase's time includes its kernels, not
    only their launch.
    """

    def __init__(self, enabled: bool = True, sync: Callable[[], None] | None = None):
        self.enabled, self._sync = enabled, sync
        self._total: dict[Phase, float] = defaultdict(float)
        self._count: dict[Phase, int] = defaultdict(int)

    @contextmanager
    def __call__(self, phase: Phase) -> Iterator[None]:
        """Time the body of a `with timers(Phase.FORWARD):` block."""
        if not isinstance(phase, Phase):
            raise TypeError(f"Timers phase {phase!r}: expected a Phase, e.g. Phase.FORWARD")
        if not self.enabled:
            yield
            return
        self._barrier()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._barrier()
            self._total[phase] += time.perf_counter() - start
            self._count[phase] += 1

    def add(self, phase: Phase, seconds: float) -> None:
        """Count time measured elsewhere, e.g. comm's TRAFFIC seconds for Phase.COMMUNICATION."""
        if not isinstance(phase, Phase):
            raise TypeError(f"Timers phase {phase!r}: expected a Phase, e.g. Phase.COMMUNICATION")
        if self.enabled:
            self._total[phase] += seconds
            self._count[phase] += 1

    def _barrier(self) -> None:
        if self._sync is not None:
            self._sync()

    def elapsed_ms(self, reset: bool = True) -> dict[str, float]:
        """Milliseconds spent per phase since the last reset, keyed by phase value."""
        out = {p.value: 1e3 * self._total[p] for p in Phase if self._count[p]}
        if reset:
            self._total.clear()
            self._count.clear()
        return out

    def format(self, reset: bool = True) -> str:
        """One console line: 'forward 12.3 ms | backward 25.1 ms | ...'."""
        return " | ".join(f"{k} {v:.1f} ms" for k, v in self.elapsed_ms(reset).items())
