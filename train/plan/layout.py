"""Layouts the planner considers: pipe x data x sequence x tensor, schedule, chunks, micro-batches, ZeRO,
offload, recompute.

Enumeration rules (each one a fact of the runtime, not a taste):
* pipe x data x sequence x tensor = the world; tensor stays inside a node and divides the heads;
* sequence (Ulysses, pipe/sequence/) stays inside a node with the tensor axis (tensor x sequence
  ranks in one), divides each tensor rank's heads (heads / tensor: each sequence rank attends
  with heads / (tensor x sequence) of them over the whole sequence) and the sequence length
  (each rank holds an equal slice);
* the data degree divides the global batch; micro-batch size x micro-batches x data = it;
* every registered schedule with its own chunk count, interleaved 1F1B also with 2 and 4
  chunks; a schedule that rejects (stages, micro-batches) is skipped; one stage runs plain
  gradient accumulation ("1f1b" with one stage);
* the model's layers cover every virtual stage (pipe x chunks <= layers);
* ZeRO 0-2 everywhere, 3 only without a pipeline (pipezero runs ZeRO-3 inside a pipeline
  only once that issue lands); optimizer offload only with ZeRO >= 1;
* activation checkpointing off (0) or every layer (1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

from pipezero.pipe.schedule.registry import SCHEDULES, make_schedule

__all__ = ["Layout", "divisors", "enumerate_layouts"]

MICROBATCH_SIZES = (1, 2, 4, 8, 16)
INTERLEAVED_CHUNKS = (2, 4)


@dataclass(frozen=True, slots=True)
class Layout:
    """One way to run the job."""

    pipe: int
    data: int
    tensor: int
    schedule: str
    chunks: int
    microbatches: int
    microbatch_size: int
    zero: int
    offload: bool = False
    checkpoint: int = 0
    sequence: int = 1      # the sequence axis' degree (ds_config's sequence_parallel_size)

    @property
    def world(self) -> int:
        """Processes the layout needs."""
        return self.pipe * self.data * self.sequence * self.tensor

    @property
    def reducing(self) -> int:
        """Ranks that reduce gradients and over which ZeRO partitions: data x sequence."""
        return self.data * self.sequence

    @property
    def label(self) -> str:
        """Short form for tables: p2 d2 t1 1f1b v1 m4x2 z2 (s4 after d when the sequence is split)."""
        extra = (" off" if self.offload else "") + (f" ck{self.checkpoint}" if self.checkpoint else "")
        seq = f" s{self.sequence}" if self.sequence > 1 else ""
        return (f"p{self.pipe} d{self.data}{seq} t{self.tensor} {self.schedule} v{self.chunks} "
                f"m{self.microbatches}x{self.microbatch_size} z{self.zero}{extra}")


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


@lru_cache(maxsize=4096)
def _schedules(pipe: int, microbatches: int, layers: int) -> tuple[tuple[str, int], ...]:
    """(name, chunks) pairs that accept this many stages and micro-batches."""
    if pipe == 1:
        return (("1f1b", 1),)
    return tuple(_valid(pipe, microbatches, layers))


def _valid(pipe: int, microbatches: int, layers: int) -> Iterator[tuple[str, int]]:
    for entry in SCHEDULES.values():
        for chunks in (INTERLEAVED_CHUNKS if entry.variable_chunks else (entry.chunks,)):
            if pipe * chunks > layers:
                continue
            try:  # a schedule checks (stages, micro-batches) up front; a small count shows the rule
                make_schedule(entry.name, min(microbatches, 4 * pipe) if microbatches % pipe == 0 else microbatches,
                              chunks if entry.variable_chunks else None).actions(pipe)
            except ValueError:
                continue
            yield entry.name, chunks


def enumerate_layouts(world: int, gpus_per_node: int, global_batch: int, layers: int, heads: int, *,
                      microbatch_sizes: tuple[int, ...] = MICROBATCH_SIZES,
                      checkpoints: tuple[int, ...] = (0, 1), offload: bool = True,
                      seq_len: int | None = None) -> Iterator[Layout]:
    """Every valid layout of `world` processes for a model of `layers` pipeline layers.

    `seq_len`: the tokens per sequence; given, layouts that split it over a sequence axis are
    among them (None: sequence 1 only, the planner before that axis)."""
    for tensor in divisors(world):
        if tensor > gpus_per_node or heads % tensor:
            continue
        for sequence in _sequence_degrees(world // tensor, gpus_per_node, heads, seq_len, tensor):
            rest = world // (tensor * sequence)
            for pipe in divisors(rest):
                data = rest // pipe
                if pipe > layers or global_batch % data:
                    continue
                per_rank = global_batch // data
                for size in (b for b in microbatch_sizes if per_rank % b == 0):
                    m = per_rank // size
                    for name, chunks in _schedules(pipe, m, layers):
                        yield from _variants(pipe, data, tensor, name, chunks, m, size, checkpoints, offload,
                                             sequence)


def _sequence_degrees(rest: int, gpus_per_node: int, heads: int, seq_len: int | None, tensor: int) -> list[int]:
    """Degrees of the sequence axis beside `tensor`: 1, and what divides the rest of the world, each tensor
    rank's heads (heads / tensor) and the sequence, tensor x sequence within a node."""
    if seq_len is None:
        return [1]
    return [s for s in divisors(rest)
            if tensor * s <= gpus_per_node and (heads // tensor) % s == 0 and seq_len % s == 0]


def _variants(pipe: int, data: int, tensor: int, name: str, chunks: int, m: int, size: int,
              checkpoints: tuple[int, ...], offload: bool, sequence: int = 1) -> Iterator[Layout]:
    stages = (0, 1, 2, 3) if pipe == 1 else (0, 1, 2)
    for zero in stages:
        for off in ((False, True) if offload and zero else (False,)):
            if zero and data * sequence == 1 and not off:
                continue  # sharding over one rank is stage 0 with extra steps
            for ck in checkpoints:
                yield Layout(pipe, data, tensor, name, chunks, m, size, zero, off, ck, sequence)
