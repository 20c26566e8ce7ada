"""Documents from the files a user brings: text, JSON Lines, Parquet / Arrow tables.

A document is one training example as text plus the character spans whose tokens are
trained on (the whole text for language modelling; the completion or the assistant turns
for supervised fine-tuning). Every document knows where it came from (`file:line`), so a
bad record is refused with its place and the fix, before any token is made.

Formats, by suffix; a folder is read recursively, its files in sorted order:
- .txt / .md / .text (and any other suffix that is UTF-8 text): one document per file.
- .jsonl / .json (one object per line), .parquet, .arrow / .feather (pyarrow, the `arrow`
  extra; a `datasets` save_to_disk folder too, one split's: a DatasetDict's is refused): one
  document per record. The first record picks
  the kind, every record keeps it: `messages` (a chat, rendered later by the tokenizer's own
  template; ShareGPT's `conversations` of from/value too), `prompt` + `completion` (loss on
  the completion), or the text field (`text` unless named).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Document", "TABLE_SUFFIXES", "TEXT_SUFFIXES", "data_files", "read_documents"]

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
TABLE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".feather")
_TOKEN_SUFFIXES = (".bin", ".npy")  # pre-tokenized: train/data/stream.py
# the metadata files of a Hugging Face `datasets` save_to_disk folder (its rows are the .arrow files)
_DATASET_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "model": "assistant"}


@dataclass(frozen=True)
class Document:
    """One example: `text` (or a chat's `messages`), and where loss counts.

    kind: "text" (loss on every token), "completion" (loss on `completion` only, appended to
    `text`, the prompt) or "chat" (loss on the assistant turns of `messages`).
    """

    origin: str                      # "path:line" (line 0: the whole file)
    kind: str
    text: str = ""
    completion: str = ""
    messages: tuple = field(default=())


def data_files(path: str | os.PathLike) -> list[Path]:
    """The files of `path` (a file, or a folder read recursively in sorted order)."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"--data {str(root)!r} is neither a file nor a folder; pass a .txt/.jsonl/.parquet "
                                f"file or a folder of them")
    _refuse_split_dicts(root)
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not p.name.startswith(".") and p.name not in _DATASET_METADATA)
    if not files:
        raise ValueError(f"--data {str(root)!r} is an empty folder; put text, .jsonl or .parquet files in it")
    return files


def _refuse_split_dicts(root: Path) -> None:
    """A `datasets` DatasetDict folder holds every split (train, test...): read whole, the held-out
    splits would be trained on. Refused, naming its splits; one split's folder is read."""
    for marker in sorted(root.rglob("dataset_dict.json")):
        try:
            splits = json.loads(marker.read_text())["splits"]
        except (OSError, ValueError, TypeError, KeyError):
            splits = sorted(p.name for p in marker.parent.iterdir() if p.is_dir())
        first = marker.parent / (splits[0] if splits else "train")
        raise ValueError(f"--data {str(root)!r}: {str(marker.parent)!r} is a `datasets` DatasetDict with the splits "
                         f"{splits}; reading it whole would train on all of them; pass one split's folder, e.g. "
                         f"--data {str(first)!r}")


def read_documents(path: str | os.PathLike, text_field: str = "text") -> Iterator[Document]:
    """Every document of `path`, in order; a bad record raises ValueError naming file, line and fix."""
    for file in data_files(path):
        if file.suffix in _TOKEN_SUFFIXES:
            raise ValueError(f"{file}: pre-tokenized {file.suffix} files hold token ids, not documents; pass them "
                             f"alone as --data-path (examples/train_gpt.py) or keep text/.jsonl files in --data")
        if file.suffix in (".jsonl", ".json"):
            yield from _records(file, _json_lines(file), text_field)
        elif file.suffix in (".parquet", ".arrow", ".feather"):
            yield from _records(file, _table_rows(file), text_field)
        else:
            yield _text_file(file)


def _text_file(file: Path) -> Document:
    raw = file.read_bytes()
    if not raw.strip():
        raise ValueError(f"{file}: the file is empty; remove it from --data or put text in it")
    if b"\0" in raw[:8192]:
        raise ValueError(f"{file}: a binary file (NUL bytes), not text; remove it from --data, or pass token "
                         f"ids as a .npy / .bin file through --data-path")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not UTF-8 text (byte {err.start}); convert it (iconv -t utf-8) or remove it "
                         f"from --data") from err
    return Document(f"{file}:0", "text", text)


def _json_lines(file: Path) -> Iterator[tuple[int, Any]]:
    with open(file, "rb") as f:
        head = f.read(8192)
        if not head.strip():
            raise ValueError(f"{file}: the file is empty; remove it from --data or write one JSON object per line")
        if b"\0" in head:
            raise ValueError(f"{file}: a binary file (NUL bytes), not JSON Lines; remove it from --data")
        f.seek(0)
        if head.lstrip()[:1] == b"[":  # one JSON array of records
            for i, record in enumerate(_loads(file, 1, f.read())):
                yield i + 1, record
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, _loads(file, number, line)


def _loads(file: Path, number: int, line: bytes) -> Any:
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}:{number}: not valid JSON ({err}); write one JSON object per line") from err


def _table_rows(file: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"{file}: Parquet and Arrow files need pyarrow: pip install 'pipezero[arrow]'") from err
    try:
        if file.suffix == ".parquet":
            table = pq.read_table(file)
        else:
            with pa.memory_map(str(file)) as source:
                try:
                    table = pa.ipc.open_file(source).read_all()
                except pa.ArrowInvalid:
                    source.seek(0)
                    table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{file}: not a readable {file.suffix} table ({err}); write it with pyarrow or "
                         f"datasets' to_parquet, or remove it from --data") from err
    if table.num_rows == 0:
        raise ValueError(f"{file}: the table has no rows; remove it from --data")
    row = 0
    for batch in table.to_batches(max_chunksize=4096):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _records(file: Path, rows: Iterator[tuple[int, Any]], text_field: str) -> Iterator[Document]:
    kind = None
    for number, record in rows:
        where = f"{file}:{number}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object per line, got {type(record).__name__}; write "
                             f'{{"{text_field}": "..."}} per line')
        kind = kind or _kind(record, text_field)
        yield _document(where, kind, record, text_field)
    if kind is None:
        raise ValueError(f"{file}: no records; remove it from --data or write one JSON object per line")


def _refuse_null_contents(where: str, messages: list) -> None:
    """A turn whose content is null (or not text) would render as an empty turn, an assistant's as an empty answer
    trained on; an assistant turn that calls tools may have none."""
    for j, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, (str, list)) or (content is None and m["role"] == "assistant" and m.get("tool_calls")):
            continue
        shown = "null" if content is None else f"a {type(content).__name__}"
        raise ValueError(f"{where}: messages[{j}] (role {m['role']!r}) has \"content\": {shown}; a turn needs its "
                         f"text (an assistant's null content would train an empty answer): write the text, or drop "
                         f"the turn or the line")


def _kind(record: dict, text_field: str) -> str:
    if "messages" in record or "conversations" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "completion"
    return "text"


_WANTS = {"chat": '"messages": [{"role": ..., "content": ...}, ...]',
          "completion": '"prompt": "..." and "completion": "..."'}


def _document(where: str, kind: str, record: dict, text_field: str) -> Document:
    if kind == "chat":
        messages = record.get("messages")
        if messages is None and isinstance(record.get("conversations"), list):  # ShareGPT: from / value
            messages = [{"role": _SHAREGPT_ROLES.get(m.get("from"), m.get("from")), "content": m.get("value")}
                        if isinstance(m, dict) and "from" in m else m for m in record["conversations"]]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
            raise ValueError(f"{where}: field 'messages' missing or not a list of {{role, content}} objects (the "
                             f"file's first record is a chat); give every line {_WANTS['chat']}")
        _refuse_null_contents(where, messages)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the chat has no assistant turn, so nothing would be trained on; add one "
                             f"or drop the line")
        return Document(where, kind, messages=tuple(messages))
    if kind == "completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: fields 'prompt' and 'completion' must both be strings (the file's first "
                             f"record has them); give every line {_WANTS['completion']}")
        if not completion:
            raise ValueError(f"{where}: the completion is empty, so nothing would be trained on; drop the line")
        return Document(where, kind, prompt, completion)
    text = record.get(text_field)
    if text_field in record and not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(text).__name__} ({str(text)[:40]}), not a "
                         f'string; give every line {{"{text_field}": "..."}}, or name the text field with '
                         "--text-field")
    if not isinstance(text, str):
        fields = sorted(record)
        raise ValueError(f"{where}: no string field {text_field!r} (the record has {fields}); give every line "
                         f'{{"{text_field}": "..."}}, or name the field with --text-field')
    if not text.strip():
        raise ValueError(f"{where}: field {text_field!r} is empty; drop the line")
    return Document(where, kind, text)
