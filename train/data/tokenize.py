"""The model directory's own tokenizer, and documents to token ids and loss masks in worker processes.

The loss masks are TRL's (train/data/masks.py). Work is spread over worker processes
(`workers`), each loading the tokenizer once from the model directory; nothing is downloaded
(local_files_only). The tokenizer is loaded here first, so a model directory without one is
refused once, before any worker starts. A worker dies with its parent (Linux: the parent-death
signal), so a build killed by SIGKILL or SIGTERM leaves no tokenizer process behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from pipezero.train.data.masks import encode
from pipezero.train.data.sources import Document

__all__ = ["encode", "encode_many", "load_tokenizer", "tokenizer_hash"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                    "added_tokens.json", "spiece.model")


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """transformers' AutoTokenizer of a local model directory (the `hf` extra), never downloading."""
    root = Path(model_dir)
    if not any((root / f).exists() for f in _TOKENIZER_FILES):
        raise ValueError(f"{root}: no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...); save the tokenizer "
                         f"beside the model (tokenizer.save_pretrained(DIR)) or pass pre-tokenized ids as .npy")
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ImportError("tokenizing --data needs transformers: pip install 'pipezero[hf]'") from err
    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{root}: transformers cannot load the tokenizer saved there ({type(err).__name__}: "
                         f"{err}); save it again beside the model (tokenizer.save_pretrained(DIR))") from err


def tokenizer_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over the tokenizer's files: equal hashes tokenize alike."""
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# -- workers ----------------------------------------------------------------------------------
_WORKER_TOKENIZER: Any = None


def _init_worker(model_dir: str, parent: int) -> None:
    global _WORKER_TOKENIZER
    _die_with(parent)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_TOKENIZER = load_tokenizer(model_dir)


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent ends, however the parent ends (Linux prctl
    PR_SET_PDEATHSIG); a parent already gone before the call ends the worker here."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def _encode_chunk(docs: Sequence[Document]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [encode(_WORKER_TOKENIZER, d) for d in docs]


def _chunks(docs: Iterable[Document], size: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encode_many(model_dir: str | os.PathLike, docs: Iterable[Document], workers: int = 0,
                chunk_docs: int = 256) -> Iterator[tuple[Document, tuple[np.ndarray, np.ndarray]]]:
    """(document, encode()) of every document, in order, streaming: `workers` > 0 spreads chunks over
    that many processes (forked: each loads the tokenizer once; at most 4 chunks per worker in
    flight, so memory stays flat however large the data), 0 runs here. The tokenizer is loaded
    here first either way: a directory without one is refused once, not in every worker."""
    tokenizer = load_tokenizer(model_dir)
    if workers <= 0:
        for doc in docs:
            yield doc, encode(tokenizer, doc)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the Rust pool must not be live across the fork
    pool = ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=_init_worker,
                               initargs=(str(model_dir), os.getpid()))
    try:
        pending: deque = deque()
        for chunk in _chunks(docs, chunk_docs):
            pending.append((chunk, pool.submit(_encode_chunk, chunk)))
            if len(pending) >= 4 * workers:
                chunk, done = pending.popleft()
                yield from zip(chunk, done.result())
        while pending:
            chunk, done = pending.popleft()
            yield from zip(chunk, done.result())
    finally:  # an error (a bad record, ^C): the chunks in flight are dropped, not waited for
        pool.shutdown(wait=False, cancel_futures=True)
