"""Layouts the planner considers: pipe x data x expert x sequence x tensor, schedule, chunks, micro-batches,
ZeRO, offload, recompute.

Enumeration rules (each one a fact of the runtime, not a taste):
* pipe x data x expert x sequence x tensor = the world; tensor stays inside a node and divides the heads;
* expert (pipe/expert/, Grid(expert=E)) splits what would be the data axis: E divides the
  model's experts, stays inside a node with the tensor and sequence axes (its group's ranks lie
  tensor x sequence apart), and each of the data x expert ranks takes its own rows; beside a tensor
  split each tensor rank routes its share of them (pipe/tensor_tokens.py);
* sequence (Ulysses, pipe/sequence/) stays inside a node with the tensor axis (tensor x sequence
  ranks in one), divides each tensor rank's heads (heads / tensor: each sequence rank attends
  with heads / (tensor x sequence) of them over the whole sequence) and the sequence length
  (each rank holds an equal slice);
* data x expert divides the global batch; micro-batch size x micro-batches x data x expert = it;
* every registered schedule with its own chunk count, interleaved 1F1B also with 2 and 4
  chunks; a schedule that rejects (stages, micro-batches) is skipped; one stage runs plain
  gradient accumulation ("1f1b" with one stage);
* the model's layers cover every virtual stage (pipe x chunks <= layers);
* ZeRO 0-3 everywhere, under every schedule (pipezero runs ZeRO-3 inside the pipeline, the schedule
  saying when each chunk is gathered: zero3.py); reshard_after_forward both ways only where a rank runs
  3 or more chunks (with one or two the prefetched next chunk keeps every chunk whole anyway, so
  resharding only adds gathers: zero3.py); optimizer offload only with ZeRO >= 1;
* activation checkpointing off (0) or every layer (1), full or selective (the matmuls' outputs kept),
  its inputs on the device or in pinned host memory (where the hardware has a host to offload to);
  with one chunk a rank, the prediction may offload only the first layers' inputs (host_layers: as
  many as the host holds) or, on the device, checkpoint only the first layers (checkpoint_layers: as
  few as the device holds: planner.predict_fitted), never an enumerated choice;
  the MLP in row tiles and the fused head + loss are not choices: the runtime tiles from
  TILE_FROM_ROWS tokens a micro-batch (pipe/tiled_mlp.py) and the shape says whether the loss is fused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

from pipezero.pipe.schedule.registry import SCHEDULES, make_schedule

__all__ = ["Layout", "divisors", "enumerate_layouts"]

MICROBATCH_SIZES = (1, 2, 4, 8, 16)
_KITS = ((False, False), (True, False))  # checkpointed: (selective, inputs on the host)
_KITS_HOST = _KITS + ((False, True), (True, True))
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
    selective: bool = False     # checkpointed runs keep the matmuls' outputs (pipe/memory/recompute.py)
    host_inputs: bool = False   # checkpointed runs' inputs in pinned host memory (cpu_checkpointing)
    expert: int = 1        # the expert axis' degree: data x expert ranks share the dense reduction
    reshard: bool = False  # ZeRO-3: a chunk freed whenever another runs (the pipeline's reshard_after_forward)
    host_layers: int | None = None  # host_inputs: only the chunk's first N layers offload (None: all of them)
    checkpoint_layers: int | None = None  # only the chunk's first N layers checkpointed (None: all of them)

    def __post_init__(self) -> None:
        if self.host_layers is not None and not (self.host_inputs and self.checkpoint and self.chunks == 1
                                                 and self.host_layers >= 1):
            raise ValueError(f"Layout(host_layers={self.host_layers!r}): a positive count, with host_inputs and "
                             f"checkpointing, at one chunk a rank (chunks={self.chunks})")
        if self.checkpoint_layers is not None and not (self.checkpoint and not self.host_inputs and self.chunks == 1
                                                       and self.checkpoint_layers >= 1):
            raise ValueError(f"Layout(checkpoint_layers={self.checkpoint_layers!r}): a positive count, with "
                             f"checkpointing on the device, at one chunk a rank (chunks={self.chunks})")

    @property
    def may_offload_fewer(self) -> bool:
        """May predict_fitted offload only the first layers' inputs (a host_layers twin)?"""
        return bool(self.checkpoint and self.host_inputs and self.host_layers is None and self.chunks == 1)

    @property
    def may_checkpoint_fewer(self) -> bool:
        """May predict_fitted checkpoint only the first layers (a checkpoint_layers twin)?"""
        return bool(self.checkpoint and not self.host_inputs and self.checkpoint_layers is None
                    and self.chunks == 1)

    def checkpoints(self, position: int) -> bool:
        """Is the run starting at a chunk's `position`-th layer (from 0) checkpointed? RecomputeConfig's
        rule, with checkpoint_layers as its own."""
        return bool(self.checkpoint) and (self.checkpoint_layers is None or position < self.checkpoint_layers)

    def on_host(self, position: int) -> bool:
        """Does the checkpointed run starting at a chunk's `position`-th layer (from 0) keep its input on the
        host? RecomputeConfig.on_host's rule, with host_layers as its offload_layers."""
        return (self.checkpoints(position) and self.host_inputs
                and (self.host_layers is None or position < self.host_layers))

    @property
    def world(self) -> int:
        """Processes the layout needs."""
        return self.pipe * self.data * self.expert * self.sequence * self.tensor

    @property
    def reducing(self) -> int:
        """Ranks that reduce the dense gradients and over which ZeRO partitions: data x expert x sequence."""
        return self.data * self.expert * self.sequence

    @property
    def expert_holders(self) -> int:
        """Ranks that hold the same experts, their reduction and ZeRO group: data x sequence x tensor at any expert
        degree (Grid's expert_data_group: whole experts on every tensor rank, each routing its share of the
        tokens, summed once a step: pipe/tensor_tokens.py); without a tensor split and an expert axis, the
        dense group's ranks."""
        return self.data * self.sequence * self.tensor

    @property
    def replicas(self) -> int:
        """Ranks that take different rows of the batch: data x expert."""
        return self.data * self.expert

    @property
    def recompute(self) -> str:
        """The checkpointing mode as RecomputeConfig names it: none, full or selective."""
        return "none" if not self.checkpoint else "selective" if self.selective else "full"

    @property
    def label(self) -> str:
        """Short form for tables: p2 d2 t1 1f1b v1 m4x2 z2 (e2 and s4 after d when the experts or the sequence
        are split; rs ZeRO-3 chunks freed whenever another runs; ck1 checkpointed, ck1s selectively, +h its
        inputs on the host, +h26 the first 26 layers' only; ck1:12 the first 12 layers checkpointed)."""
        host = ("+h" + (str(self.host_layers) if self.host_layers else "")) if self.host_inputs else ""
        first = f":{self.checkpoint_layers}" if self.checkpoint_layers else ""
        kit = f" ck{self.checkpoint}{first}" + ("s" if self.selective else "") + host
        extra = (" rs" if self.reshard else "") + (" off" if self.offload else "") + (kit if self.checkpoint else "")
        seq = (f" e{self.expert}" if self.expert > 1 else "") + (f" s{self.sequence}" if self.sequence > 1 else "")
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
                      seq_len: int | None = None, experts: int = 0) -> Iterator[Layout]:
    """Every valid layout of `world` processes for a model of `layers` pipeline layers.

    `seq_len`: the tokens per sequence; given, layouts that split it over a sequence axis are
    among them (None: sequence 1 only, the planner before that axis). `experts`: a MoE's experts
    per layer; given, layouts with an expert axis (Grid(expert=E): E divides the experts and what
    would be the data axis, within a node) are among them. `offload`: whether the host takes the
    optimizer and the checkpointed inputs."""
    for tensor in divisors(world):
        if tensor > gpus_per_node or heads % tensor:
            continue
        for sequence in _sequence_degrees(world // tensor, gpus_per_node, heads, seq_len, tensor):
            rest = world // (tensor * sequence)
            for pipe in divisors(rest):
                replicas = rest // pipe
                if pipe > layers or global_batch % replicas:
                    continue
                per_rank = global_batch // replicas
                for expert in _expert_degrees(replicas, gpus_per_node, experts, sequence * tensor):
                    for size in (b for b in microbatch_sizes if per_rank % b == 0):
                        m = per_rank // size
                        for name, chunks in _schedules(pipe, m, layers):
                            yield from _variants(pipe, replicas // expert, tensor, name, chunks, m, size,
                                                 checkpoints, offload, sequence, expert)


def _expert_degrees(replicas: int, gpus_per_node: int, experts: int, stride: int) -> list[int]:
    """Degrees of the expert axis: 1, and what divides the data ranks and the experts, the group within a
    node (its ranks lie `stride` = sequence x tensor apart, Grid's order: expert x sequence x tensor
    consecutive ranks)."""
    if not experts:
        return [1]
    return [e for e in divisors(replicas) if e * stride <= gpus_per_node and experts % e == 0]


def _sequence_degrees(rest: int, gpus_per_node: int, heads: int, seq_len: int | None, tensor: int) -> list[int]:
    """Degrees of the sequence axis beside `tensor`: 1, and what divides the rest of the world, each tensor
    rank's heads (heads / tensor) and the sequence, tensor x sequence within a node."""
    if seq_len is None:
        return [1]
    return [s for s in divisors(rest)
            if tensor * s <= gpus_per_node and (heads // tensor) % s == 0 and seq_len % s == 0]


def _variants(pipe: int, data: int, tensor: int, name: str, chunks: int, m: int, size: int,
              checkpoints: tuple[int, ...], offload: bool, sequence: int = 1, expert: int = 1) -> Iterator[Layout]:
    for zero in (0, 1, 2, 3):
        for off in ((False, True) if offload and zero else (False,)):
            if zero and data * expert * sequence == 1 and not off:
                continue  # sharding over one rank is stage 0 with extra steps
            for reshard in ((False, True) if zero == 3 and chunks >= 3 else (False,)):
                for ck in checkpoints:
                    for selective, host in (_KITS_HOST if ck and offload else _KITS if ck else ((False, False),)):
                        yield Layout(pipe, data, tensor, name, chunks, m, size, zero, off, ck, sequence, selective,
                                     host, expert, reshard)
