"""Documents into rows: packed end to end into fixed-length rows, or one per row.

A row is a list of segments, each a stretch of one document. Packed (`packing=True`), the
documents fill rows of exactly `seq_len` tokens in order, a document that does not fit the
rest of a row starting the next one (the rest is padding, its own segment). Unpacked, each
document is a row of its own length (batches pad per micro-batch: train/data/batches.py).
A document longer than `seq_len` is split into pieces of `seq_len` (or truncated,
`long_docs="truncate"`), said once in the log with the count, never silently.

Per row the model gets ids, position ids restarting at 0 in every segment, and segment ids
(attention stays inside a segment: a block-diagonal causal mask); the labels are the next
token within the segment where the loss mask is 1, -100 elsewhere (no loss across a
boundary, none on a segment's last token or on padding).
Packing efficiency = real tokens / token slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipezero.train.log import get_logger

__all__ = ["Corpus", "IGNORE", "Layout", "MemoryCorpus", "Row", "pack"]

IGNORE = -100  # the label of a token without loss (torch's cross_entropy ignore_index)
log = get_logger("data")


class Corpus(Protocol):
    """What packing reads: document i's (ids, loss mask); TokenizedCorpus and MemoryCorpus have it."""

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...
    def lengths(self) -> np.ndarray: ...
    def label_counts(self) -> np.ndarray: ...  # per document, its tokens past the first with mask 1


class MemoryCorpus:
    """Documents held in memory: a list of (ids, loss mask) (mask None: every token)."""

    def __init__(self, docs: list):
        self.docs = [(np.asarray(ids, dtype=np.int64),
                      np.ones(len(ids), np.uint8) if mask is None else np.asarray(mask, dtype=np.uint8))
                     for ids, mask in (d if isinstance(d, tuple) else (d, None) for d in docs)]

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.docs[i]

    def lengths(self) -> np.ndarray:
        return np.asarray([len(ids) for ids, _ in self.docs], dtype=np.int64)

    def label_counts(self) -> np.ndarray:
        return np.asarray([int(mask[1:].sum()) for _, mask in self.docs], dtype=np.int64)

    @property
    def num_docs(self) -> int:
        return len(self.docs)


@dataclass(frozen=True)
class Row:
    """One row's tensors as int64 arrays of its length."""

    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    segments: np.ndarray


@dataclass(frozen=True)
class Layout:
    """Which document stretches make each row (segment arrays, CSR-style by row)."""

    row_start: np.ndarray   # int64 [rows + 1]: row r holds segments row_start[r]:row_start[r + 1]
    seg_doc: np.ndarray     # int64 [segments]: the document of each segment
    seg_from: np.ndarray    # int64: first token of the stretch within its document
    seg_len: np.ndarray     # int64: tokens in the stretch
    seq_len: int            # packed row length (0: unpacked, rows of their own length)
    pad_id: int

    @property
    def num_rows(self) -> int:
        return len(self.row_start) - 1

    def row_length(self, r: int) -> int:
        return self.seq_len or int(self.seg_len[self.row_start[r]:self.row_start[r + 1]].sum())

    def efficiency(self) -> float:
        """Real tokens / token slots over all rows (1.0 unpacked: padding comes per batch)."""
        slots = self.seq_len * self.num_rows if self.seq_len else int(self.seg_len.sum())
        return float(self.seg_len.sum()) / max(1, slots)

    def row(self, r: int, corpus: Corpus) -> Row:
        """Row r's ids, labels, position ids and segment ids (padded to seq_len when packed)."""
        n = self.row_length(r)
        ids = np.full(n, self.pad_id, dtype=np.int64)
        labels = np.full(n, IGNORE, dtype=np.int64)
        positions = np.zeros(n, dtype=np.int64)
        segments = np.zeros(n, dtype=np.int64)
        at = 0
        for k, s in enumerate(range(self.row_start[r], self.row_start[r + 1])):
            doc_ids, doc_mask = corpus.doc(int(self.seg_doc[s]))
            a, length = int(self.seg_from[s]), int(self.seg_len[s])
            piece, mask = np.asarray(doc_ids[a:a + length], np.int64), np.asarray(doc_mask[a:a + length])
            ids[at:at + length] = piece
            labels[at:at + length - 1] = np.where(mask[1:] > 0, piece[1:], IGNORE)
            positions[at:at + length] = np.arange(length)
            segments[at:at + length] = k
            at += length
        if at < n:  # padding: a segment of its own, positions from 0, no loss
            positions[at:] = np.arange(n - at)
            segments[at:] = self.row_start[r + 1] - self.row_start[r]
        return Row(ids, labels, positions, segments)

    def trained_tokens(self, corpus: Corpus) -> np.ndarray:
        """Per row, the tokens with a label (what a per-token mean divides by); whole documents
        from the corpus's per-document counts, only the pieces of split ones read here."""
        whole = (self.seg_from == 0) & (self.seg_len == np.asarray(corpus.lengths())[self.seg_doc])
        counts = np.where(whole, np.asarray(corpus.label_counts())[self.seg_doc], 0)
        for s in np.flatnonzero(~whole):
            _, mask = corpus.doc(int(self.seg_doc[s]))
            a, length = int(self.seg_from[s]), int(self.seg_len[s])
            counts[s] = int(np.asarray(mask[a + 1:a + length]).sum())
        if not self.num_rows:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(counts, self.row_start[:-1]).astype(np.int64)


def pack(corpus: Corpus, seq_len: int, packing: bool = True, long_docs: str = "split", pad_id: int = 0,
         source: str = "data") -> Layout:
    """The rows of `corpus`'s documents in order (see the module docstring)."""
    if long_docs not in ("split", "truncate"):
        raise ValueError(f"long_docs={long_docs!r}: expected 'split' or 'truncate'")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: expected an integer >= 2 (a token and its next one)")
    lengths = np.asarray(corpus.lengths(), dtype=np.int64)
    pieces = _pieces(lengths, seq_len, long_docs, source)
    rows, segs, used = [0], [], 0
    for doc, start, length in pieces:
        if packing and used and used + length > seq_len:
            rows.append(len(segs))
            used = 0
        segs.append((doc, start, length))
        used += length
        if not packing:
            rows.append(len(segs))
            used = 0
    if segs and rows[-1] != len(segs):
        rows.append(len(segs))
    seg = np.asarray(segs, dtype=np.int64).reshape(-1, 3)
    layout = Layout(np.asarray(rows, np.int64), seg[:, 0], seg[:, 1], seg[:, 2], seq_len if packing else 0, pad_id)
    if packing:
        log.info("%s: %d documents packed into %d rows of %d tokens, packing efficiency %.1f%%", source,
                 len(lengths), layout.num_rows, seq_len, 100 * layout.efficiency())
    return layout


def _pieces(lengths: np.ndarray, seq_len: int, long_docs: str, source: str) -> list[tuple[int, int, int]]:
    """(document, first token, length) stretches of at most seq_len tokens (pieces of >= 2 tokens)."""
    out, long = [], 0
    for doc, n in enumerate(lengths.tolist()):
        if n <= seq_len:
            out.append((doc, 0, n))
            continue
        long += 1
        if long_docs == "truncate":
            out.append((doc, 0, seq_len))
            continue
        for a in range(0, n, seq_len):
            if n - a >= 2:
                out.append((doc, a, min(seq_len, n - a)))
    if long:
        log.warning("%s: %d of %d documents are longer than seq_len=%d tokens: %s (long_docs=%r; the model "
                    "never sees a sequence beyond its positions)", source, long, len(lengths), seq_len,
                    "split into pieces of seq_len" if long_docs == "split" else "truncated to seq_len", long_docs)
    return out
