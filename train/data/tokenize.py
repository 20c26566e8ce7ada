"""Documents to token ids and loss masks with the model directory's own tokenizer.

Loss masks follow Hugging Face TRL's SFT at the token level: a plain text trains on every
token; a prompt/completion pair tokenizes the prompt and the prompt + completion and trains
on the tokens past the prompt's count (TRL's completion mask); a chat is rendered by the
tokenizer's own chat template and trains on the assistant turns, each from the end of the
generation prompt before it to the end of its own rendering (the end-of-turn tokens the
template writes included), as TRL's assistant-only loss does with the template's generation
marks. EOS closes every non-chat document (TRL appends it; the chat template writes its own).

Work is spread over worker processes (`workers`), each loading the tokenizer once from the
model directory; nothing is downloaded (local_files_only).
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

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
    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def tokenizer_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over the tokenizer's files: equal hashes tokenize alike."""
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def encode(tokenizer: Any, doc: Document) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, loss mask uint8: 1 where the token is trained on) of one document."""
    if doc.kind == "chat":
        return _chat(tokenizer, doc)
    eos = tokenizer.eos_token_id
    if doc.kind == "completion":
        prompt = tokenizer(doc.text)["input_ids"]
        ids = tokenizer(doc.text + doc.completion)["input_ids"]
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    else:
        ids = tokenizer(doc.text)["input_ids"]
        mask = [1] * len(ids)
    if eos is not None and (not ids or ids[-1] != eos):
        ids, mask = ids + [eos], mask + [1]
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def _chat(tokenizer: Any, doc: Document) -> tuple[np.ndarray, np.ndarray]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{doc.origin}: a chat record, but the tokenizer has no chat template (its "
                         f"tokenizer_config.json lacks 'chat_template'); add the model's template there, or write "
                         f"the data as prompt/completion pairs")
    messages = list(doc.messages)
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tokenize=False, add_generation_prompt=gen)
    try:
        full = render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start, through = render(messages[:i], gen=True) if i else "", render(messages[:i + 1])
                if not (full.startswith(start) and full.startswith(through)):
                    raise ValueError(f"{doc.origin}: the chat template renders the conversation's beginning "
                                     f"differently from the whole, so assistant turns cannot be located; use "
                                     f"prompt/completion pairs for this model")
                spans.append((len(start), len(through)))
    except ValueError:
        raise
    except Exception as err:  # jinja's TemplateError and the template's own raise_exception
        raise ValueError(f"{doc.origin}: the tokenizer's chat template refused this conversation ({err}); "
                         f"fix the record's roles/contents") from err
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for a, b in spans:
        mask |= ((starts >= a) & (starts < b)).astype(np.uint8)
    return np.asarray(enc["input_ids"], dtype=np.int64), mask


# -- workers ----------------------------------------------------------------------------------
_WORKER_TOKENIZER: Any = None


def _init_worker(model_dir: str) -> None:
    global _WORKER_TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_TOKENIZER = load_tokenizer(model_dir)


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
    flight, so memory stays flat however large the data), 0 runs here."""
    if workers <= 0:
        tokenizer = load_tokenizer(model_dir)
        for doc in docs:
            yield doc, encode(tokenizer, doc)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the Rust pool must not be live across the fork
    with ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=_init_worker,
                             initargs=(str(model_dir),)) as pool:
        pending: deque = deque()
        for chunk in _chunks(docs, chunk_docs):
            pending.append((chunk, pool.submit(_encode_chunk, chunk)))
            if len(pending) >= 4 * workers:
                chunk, done = pending.popleft()
                yield from zip(chunk, done.result())
        while pending:
            chunk, done = pending.popleft()
            yield from zip(chunk, done.result())
