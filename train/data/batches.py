"""Rows into pipeline batches: a resumable global order, micro-batches, and the per-token loss.

Order: every step takes one global batch of `global_batch` rows from a seeded permutation per
epoch; data rank r of D takes the r-th contiguous block of global_batch / D rows. The
position (epoch, step, seed, global batch) is what a checkpoint keeps (`state_dict`), so a
resumed run, on the same or another data degree, sees exactly the rows the uninterrupted run
would have seen next. D counts every rank that reads its own rows: with an expert axis the data x
expert ranks (`grid.data_expert_rank` of `grid.data_expert_size`, as the jobs pass them).

Batch: the first stage's inputs are (ids, position ids, segment ids) [B, T] (the Hugging
Face layers of pipe/hf/layers.py take (ids, None, position ids): transformers builds the
block-diagonal mask from positions that restart); the last stage's targets are (labels,
scale) where scale [B] holds m * D / N, N the global batch's trained tokens. With
`token_mean_loss` each micro-batch's loss is its summed cross-entropy times that scale; the
runner's mean over m micro-batches and the replicas' mean over D then give exactly the mean
over every trained token of the global batch (as one process computes it, and as TRL
normalises), however the tokens fall into micro-batches. With a sequence axis each sequence
rank takes one slice of every row (`sequence_rank`, pipe/sequence/batch.py), and the loss,
wrapped in pipe/sequence's ShardSum, is multiplied by the degree (the mean over ranks divides by it).

Unpacked rows differ in length: `pad="microbatch"` pads each micro-batch to its longest row
and returns the step as a list of micro-batches (PipelineRunner(variable_shapes=True) takes
it); `pad="step"` pads the whole step to its longest row (one tensor per input).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipezero.pipe.fused_loss import HeadLogits, fused_cross_entropy
from pipezero.pipe.sequence.batch import shard_sequence

from pipezero.train.data.packing import IGNORE, Corpus, Layout

__all__ = ["GlobalOrder", "PackedBatches", "token_mean_loss"]


class GlobalOrder:
    """Which rows each step takes: a seeded permutation per epoch, cut into global batches."""

    def __init__(self, num_rows: int, global_batch: int, seed: int = 0, shuffle: bool = True):
        if global_batch < 1 or num_rows < global_batch:
            raise ValueError(f"{num_rows} rows are fewer than one global batch of {global_batch}; use more data, "
                             f"a smaller batch or a shorter --seq-len")
        self.num_rows, self.global_batch, self.seed, self.shuffle = num_rows, global_batch, seed, shuffle
        self.steps_per_epoch = num_rows // global_batch
        self.epoch, self.step = 0, 0
        self._perm: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.num_rows, generator=gen) if self.shuffle else torch.arange(self.num_rows)
            self._perm = (epoch, order.numpy())
        return self._perm[1]

    def next_rows(self) -> np.ndarray:
        """The next global batch's row indices (advances the position)."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        start = self.step * self.global_batch
        self.step += 1
        return self._order(self.epoch)[start:start + self.global_batch]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; refused when the global batch or the rows differ."""
        for name, mine in (("global_batch", self.global_batch), ("rows", self.num_rows), ("seed", self.seed)):
            saved = state.get(name, mine)
            if saved != mine:
                raise ValueError(f"the checkpoint's data position has {name}={saved}, this run {mine}: keep the "
                                 f"data, --seq-len, seed and the global batch (batch size x micro-batches x data "
                                 f"degree) to resume, or start afresh in another --out")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


class PackedBatches:
    """This data rank's (inputs, targets) step after step, from a Layout over a corpus."""

    def __init__(self, layout: Layout, corpus: Corpus, batch_size: int, num_microbatches: int = 1,
                 data_rank: int = 0, data_degree: int = 1, seed: int = 0, shuffle: bool = True,
                 hf_inputs: bool = False, pad: str = "microbatch", sequence_rank: int = 0, sequence_degree: int = 1):
        if not 0 <= data_rank < data_degree:
            raise ValueError(f"data_rank={data_rank}: expected 0 <= data_rank < data_degree={data_degree}")
        if layout.seq_len % sequence_degree:
            raise ValueError(f"rows of {layout.seq_len} tokens do not split into sequence_degree={sequence_degree} "
                             f"equal slices; use a --seq-len that is a multiple of {sequence_degree}")
        if batch_size % num_microbatches:
            raise ValueError(f"batch_size={batch_size} rows per data rank do not split into "
                             f"num_microbatches={num_microbatches}; use a multiple of it")
        if pad not in ("microbatch", "step"):
            raise ValueError(f"pad={pad!r}: expected 'microbatch' or 'step'")
        self.layout, self.corpus, self.batch_size, self.m = layout, corpus, batch_size, num_microbatches
        self.data_rank, self.data_degree, self.hf_inputs, self.pad = data_rank, data_degree, hf_inputs, pad
        self.sequence_rank, self.sequence_degree = sequence_rank, sequence_degree  # each rank: a slice of each row
        self.order = GlobalOrder(layout.num_rows, batch_size * data_degree, seed, shuffle)
        self._trained = layout.trained_tokens(corpus)
        self._efficiency: tuple[int, float] = (-1, 1.0)

    def next_batch(self) -> tuple[Any, Any]:
        """(inputs, targets) of this rank's share of the next global batch (see the module docstring)."""
        rows = self.order.next_rows()
        n_trained = int(self._trained[rows].sum())
        mine = rows[self.data_rank * self.batch_size:(self.data_rank + 1) * self.batch_size]
        scale = self.m * self.data_degree / max(1, n_trained)
        per = self.batch_size // self.m
        if self.layout.seq_len or self.pad == "step":
            return self._collate(mine, scale)
        parts = [self._collate(mine[i * per:(i + 1) * per], scale) for i in range(self.m)]
        return [p[0] for p in parts], [p[1] for p in parts]

    def _collate(self, rows: np.ndarray, scale: float) -> tuple[tuple, tuple]:
        made = [self.layout.row(int(r), self.corpus) for r in rows]
        width = max(len(r.ids) for r in made)
        stack = lambda name, fill: torch.from_numpy(np.stack(  # noqa: E731
            [_pad(getattr(r, name), width, fill, name) for r in made]))
        ids, labels = stack("ids", self.layout.pad_id), stack("labels", IGNORE)
        positions, segments = stack("positions", 0), stack("segments", 0)
        inputs = (ids, None, positions) if self.hf_inputs else (ids, positions, segments)
        targets = (labels, torch.full((len(made),), scale, dtype=torch.float32))
        return (shard_sequence(inputs, self.sequence_rank, self.sequence_degree),  # labels shifted on the whole row
                shard_sequence(targets, self.sequence_rank, self.sequence_degree))

    def __iter__(self) -> "PackedBatches":
        return self

    def __next__(self) -> tuple[Any, Any]:
        return self.next_batch()

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one pass over the rows."""
        return self.order.steps_per_epoch

    def state_dict(self) -> dict[str, int]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.order.load_state_dict(state)

    def efficiency(self) -> float:
        """Real tokens / token slots: of the packed rows, or of the unpacked rows as the epoch in progress pads
        them (each micro-batch, or each step with pad="step", to its longest row; every data rank's)."""
        if self.layout.seq_len:
            return self.layout.efficiency()
        epoch = self.order.epoch
        if self._efficiency[0] != epoch:
            steps, group = self.order.steps_per_epoch, self.batch_size // self.m if self.pad == "microbatch" else \
                self.batch_size
            lengths = np.add.reduceat(self.layout.seg_len, self.layout.row_start[:-1])
            taken = lengths[self.order._order(epoch)[:steps * self.order.global_batch]].reshape(-1, group)
            self._efficiency = (epoch, float(taken.sum()) / max(1, int(taken.max(axis=1).sum()) * group))
        return self._efficiency[1]


def _pad(a: np.ndarray, width: int, fill: int, name: str) -> np.ndarray:
    if len(a) == width:
        return a
    extra = np.full(width - len(a), fill, dtype=a.dtype)
    if name == "positions":  # padding is a segment of its own, positions from 0
        extra = np.arange(width - len(a), dtype=a.dtype)
    elif name == "segments":
        extra[:] = a.max() + 1 if len(a) else 0
    return np.concatenate([a, extra])


def token_mean_loss(logits: torch.Tensor | HeadLogits, targets: tuple) -> torch.Tensor:
    """Summed next-token cross-entropy of the trained tokens (label != -100) times the batch's
    scale (of logits, or of hf_layer_specs(fused_loss=True)'s HeadLogits, never whole): the pipeline's per-micro-batch loss whose means over micro-batches and replicas are
    the global batch's per-token mean (module docstring). targets: (labels [B, T], scale [B])."""
    labels, scale = targets
    return fused_cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum") * scale[0]
