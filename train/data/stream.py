"""Byte-level token data: the standard library's own sources, or the user's text/token file.

Every machine with Python has its standard library, so the built-in corpus needs no
download: the top-level .py files of the directory holding the `os` module, in sorted
order, concatenated as bytes (vocabulary 256). The corpus hash (sha256 over names and
contents) says whether two machines trained on the same text. The last `val_fraction` of
the token stream is held out for validation.

Batches are non-overlapping windows of seq_len + 1 tokens, (inputs, targets) shifted by one.
Each optimizer step takes one global batch of `data_degree x batch_size` windows from a
seeded permutation; data rank r takes the r-th contiguous block of it, so the ranks' batches
concatenated in rank order are exactly the single-process batch (what parity tests need).
The readers are every rank whose gradients are averaged over other rows: on a grid with an
expert axis the data x expert ranks (`grid.data_expert_rank` of `grid.data_expert_size`, as the
jobs pass them), since the dense gradients are the mean over data x expert x sequence.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipezero.pipe.sequence.batch import shard_sequence, whole_positions

__all__ = ["ShardedBatches", "TokenData", "corpus_hash", "load_tokens", "stdlib_corpus", "stdlib_files"]


def stdlib_files() -> list[Path]:
    """The standard library's top-level .py files (the `os` module's directory), sorted by name."""
    root = Path(os.__file__).resolve().parent
    return sorted(p for p in root.glob("*.py") if p.is_file())


def corpus_hash(files: list[Path]) -> str:
    """sha256 over each file's name and bytes, in order: equal hashes mean equal corpora."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def stdlib_corpus() -> tuple[torch.Tensor, str]:
    """(uint8 tokens of the whole built-in corpus, its hash)."""
    files = stdlib_files()
    if not files:
        raise FileNotFoundError(f"no .py files next to {os.__file__}: this Python ships without its "
                                f"library sources; pass --data-path with a text file instead")
    blob = b"".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), corpus_hash(files)


def load_tokens(path: str | os.PathLike, vocab_size: int = 256) -> torch.Tensor:
    """Tokens of a user file: .npy (integer array), .bin (raw uint16, nanoGPT's format) or text (bytes).

    An empty file, a file of fewer than two tokens (no next-token target), a .npy that numpy
    cannot read as an array, and ids outside the vocabulary are refused with the file and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} (--data-path) is not a file; pass a text, .bin or "
                                f".npy file, or leave --data-path out for the built-in corpus")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} (--data-path) is empty: pass a file with text or token ids, or leave "
                         f"--data-path out for the built-in corpus")
    if path.suffix == ".npy":
        tokens = _npy_tokens(path)
    elif path.suffix == ".bin":
        raw = path.read_bytes()
        if len(raw) % 2:
            raise ValueError(f"{path}: {len(raw)} bytes is not a whole number of uint16 tokens (a .bin file "
                             f"holds raw uint16 ids, nanoGPT's format); rename a text file to .txt")
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint16).to(torch.int64)
    else:
        tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    if tokens.numel() < 2:
        raise ValueError(f"{path} (--data-path) holds {tokens.numel()} token: training needs at least 2 (an "
                         f"input and its next-token target), in practice more than one window of --seq-len + 1")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"{path}: token ids span [{int(tokens.min())}, {int(tokens.max())}] but the "
                         f"vocabulary has {vocab_size} entries: pass ids in [0, {vocab_size}) (the built-in GPT reads "
                         f"bytes); for a model of a larger vocabulary give its text, not its token ids, to "
                         f"examples/train_hf.py --model DIR --data TEXT (--data reads no .bin/.npy token files)")
    return tokens


def _npy_tokens(path: Path) -> torch.Tensor:
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path} (--data-path) is not a NumPy .npy file ({err}); write it with "
                         f"numpy.save(path, ids) or pass raw uint16 ids as .bin / text as .txt") from err
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{path}: expected a 1-D integer array of token ids, got {array.dtype} "
                         f"of shape {array.shape}; save numpy.asarray(ids, dtype=numpy.int32).ravel()")
    return torch.from_numpy(np.ascontiguousarray(array).astype(np.int64))


@dataclass(frozen=True)
class TokenData:
    """A token stream split into train and validation windows of seq_len (+1 for the targets)."""

    tokens: torch.Tensor
    seq_len: int
    val_fraction: float = 0.05
    source: str = ""   # what the tokens came from: "stdlib:<hash>" or a path

    @classmethod
    def stdlib(cls, seq_len: int, val_fraction: float = 0.05) -> "TokenData":
        """The built-in corpus."""
        tokens, digest = stdlib_corpus()
        return cls(tokens, seq_len, val_fraction, f"stdlib:{digest}")

    @classmethod
    def from_file(cls, path: str | os.PathLike, seq_len: int, val_fraction: float = 0.05,
                  vocab_size: int = 256) -> "TokenData":
        """A user's text/.bin/.npy file."""
        return cls(load_tokens(path, vocab_size), seq_len, val_fraction, os.fspath(path))

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction}: expected a number in (0, 1)")
        if min(self.num_windows("train"), self.num_windows("val")) < 1:
            raise ValueError(f"{self.source or 'data'}: {self.tokens.numel()} tokens are too few for "
                             f"one train and one validation window of seq_len={self.seq_len} (the last "
                             f"{self.val_fraction:g} is held out); use more text or a shorter --seq-len")

    def _split(self, split: str) -> torch.Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: expected 'train' or 'val'")
        cut = int(self.tokens.numel() * (1.0 - self.val_fraction))
        return self.tokens[:cut] if split == "train" else self.tokens[cut:]

    def fingerprint(self) -> str:
        """A short hash of the stream's length and its first and last 65,536 tokens: a resumed data position
        is refused on another corpus (cheap at any size; `source` alone would refuse a moved file)."""
        digest = hashlib.sha256(f"{self.tokens.numel()}:{self.seq_len}:{self.val_fraction}".encode())
        for part in (self.tokens[:65_536], self.tokens[-65_536:]):
            digest.update(part.to(torch.int64).numpy().tobytes())
        return digest.hexdigest()[:16]

    def num_windows(self, split: str) -> int:
        """Non-overlapping windows of seq_len + 1 tokens (neighbours share one token) in a split."""
        return max(0, (self._split(split).numel() - 1) // self.seq_len)

    def windows(self, split: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [len(index), seq_len] int64, for the given window indices."""
        tokens = self._split(split)
        starts = index.to(torch.int64)[:, None] * self.seq_len
        rows = tokens[starts + torch.arange(self.seq_len + 1)].to(torch.int64)
        return rows[:, :-1], rows[:, 1:]


class ShardedBatches:
    """This data rank's batches, step after step, from a seeded permutation per epoch.

    `state_dict()` is the position, two integers (epoch, step), and what it is a position in, so a
    resumed run continues with the very batch the interrupted one would have taken next (and a
    resume on other data is refused).
    """

    def __init__(self, data: TokenData, batch_size: int, data_rank: int = 0, data_degree: int = 1,
                 split: str = "train", seed: int = 0, shuffle: bool = True, sequence_rank: int = 0,
                 sequence_degree: int = 1):
        if not 0 <= data_rank < data_degree:
            raise ValueError(f"data_rank={data_rank}: expected 0 <= data_rank < data_degree={data_degree}")
        if data.seq_len % sequence_degree:
            raise ValueError(f"windows of {data.seq_len} tokens do not split into sequence_degree={sequence_degree} "
                             f"equal slices; use a seq_len that is a multiple of {sequence_degree}")
        self.sequence_rank, self.sequence_degree = sequence_rank, sequence_degree
        self.data, self.batch_size, self.split, self.seed, self.shuffle = data, batch_size, split, seed, shuffle
        self.data_rank, self.data_degree = data_rank, data_degree
        self.steps_per_epoch = data.num_windows(split) // (batch_size * data_degree)
        if self.steps_per_epoch < 1:
            raise ValueError(f"{split} split has {data.num_windows(split)} windows of {data.seq_len} tokens, "
                             f"fewer than one global batch of {batch_size} x {data_degree} data ranks; "
                             f"use more data, a smaller batch or a shorter seq_len")
        self.epoch, self.step = 0, 0
        self._cache: tuple[int, torch.Tensor] = (-1, torch.empty(0))

    def _order(self, epoch: int) -> torch.Tensor:
        if self._cache[0] != epoch:
            n = self.data.num_windows(self.split)
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._cache = (epoch, torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n))
        return self._cache[1]

    def next_batch(self) -> tuple[Any, torch.Tensor]:
        """(inputs, targets) of [batch_size, seq_len] for this rank's share of the next global batch; with a
        sequence degree, this rank's slice, the inputs as (ids, positions, segments)."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        global_bs = self.batch_size * self.data_degree
        start = self.step * global_bs + self.data_rank * self.batch_size
        index = self._order(self.epoch)[start:start + self.batch_size]
        self.step += 1
        x, y = self.data.windows(self.split, index)
        if self.sequence_degree == 1:
            return x, y
        # a slice of every window (pipe/sequence/): the GPT's (ids, positions, segments), positions of the whole
        x = (x, whole_positions(x), torch.zeros_like(x))
        return (shard_sequence(x, self.sequence_rank, self.sequence_degree),
                shard_sequence(y, self.sequence_rank, self.sequence_degree))

    def __iter__(self) -> "ShardedBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int | str]:
        """The position, as JSON-ready ints, the global batch it counts in, and what it is a position in
        (the corpus's fingerprint and the shuffle seed)."""
        return {"epoch": self.epoch, "step": self.step, "global_batch": self.batch_size * self.data_degree,
                "corpus": self.data.fingerprint(), "seed": self.seed}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Continue from a saved position; refused when it is in another corpus or shuffle, or counts in
        another global batch.

        A step counts global batches (data degree x batch size), so a position saved under one
        global batch points elsewhere under another. A different data degree with the same
        global batch (e.g. fewer replicas, more accumulation) continues exactly.
        """
        order = {"corpus": self.data.fingerprint(), "seed": self.seed}
        other = {k: (state[k], mine) for k, mine in order.items() if k in state and state[k] != mine}
        if other:  # older checkpoints say neither: taken as the same data
            differ = ", ".join(f"{k} {saved!r}, here {mine!r}" for k, (saved, mine) in other.items())
            raise ValueError(f"the checkpoint's data position is in another data order ({differ}): resume with the "
                             "data file, --seq-len and seed it was saved with, or start afresh in another --out")
        saved = state.get("global_batch")
        mine = self.batch_size * self.data_degree
        if saved is not None and saved != mine:
            raise ValueError(f"the checkpoint's data position counts global batches of {saved} sequences, this run "
                             f"takes {mine} ({self.data_degree} data ranks x {self.batch_size}): keep the global "
                             f"batch (batch size x micro-batches x data degree = {saved}) to resume, or start afresh "
                             f"in another --out")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
