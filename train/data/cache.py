"""The tokenized corpus on disk: written once, memory-mapped by every later run and every rank.

The cache folder is named by a key over the data files' names and bytes, the tokenizer's
files and the reading options, so any change makes a new one and equal inputs share one.
Layout: tokens.bin (uint32 ids, documents end to end), mask.bin (uint8 loss mask),
offsets.npy (int64, document i is tokens[offsets[i]:offsets[i + 1]]), origins.txt (each
document's file:line) and meta.json, written into a temporary folder and renamed whole.
meta.json holds the sha256 of the three arrays' files, checked (with their sizes) whenever the
cache is opened: a truncated or altered cache is refused, naming the folder to delete.
The temporary folder is `<key>.tmp-<host>-<pid>`; one whose process is gone (SIGKILL mid-build)
is removed by the next build on its host; SIGTERM during a build removes it at once.

Who builds it: one process per machine (LOCAL_RANK 0, or the process that wins the lock
file); the others wait for the folder, or for the builder's error file, and raise that same
error: no collective is involved, so bad input fails on every rank alike instead of leaving
peers in a barrier. The lock names its builder (host, pid): one left by a builder that died on
this host (preempted or killed mid-build, so no `finally` removed it) is taken over by the next
LOCAL_RANK 0, as train/run_dir.py does with a run's lock; one from another host is waited for,
as long as its builder touches it (every few seconds while documents come out of the
tokenizer: a long build is not a dead one, a hung one is).
The error file says when and where it was written: a waiting rank ignores one that this host
wrote before the rank's own process started (an earlier launch's, e.g. a ^C while tokenizing),
since its LOCAL_RANK 0 removes it and builds again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from pipezero.train.data.sources import data_files, read_documents
from pipezero.train.data.tokenize import encode_many, tokenizer_hash
from pipezero.train.checkpoint.files import file_sha256
from pipezero.train.run_dir import pid_alive

__all__ = ["TokenizedCorpus", "cache_key", "default_cache_dir", "tokenized_corpus"]

_VERSION = "pipezero-tokens-2"  # 2: the sha256 of the arrays in meta.json, TRL 1.16's masks
_ARRAYS = ("tokens.bin", "mask.bin", "offsets.npy")


def default_cache_dir() -> Path:
    """$PIPEZERO_CACHE, else ~/.cache/pipezero/data."""
    return Path(os.environ.get("PIPEZERO_CACHE", Path.home() / ".cache" / "pipezero" / "data"))


def cache_key(data: str | os.PathLike, model_dir: str | os.PathLike, text_field: str = "text") -> str:
    """sha256 over the data files (names relative to `data`, bytes), the tokenizer and the options."""
    digest = hashlib.sha256(f"{_VERSION}\0{text_field}\0{tokenizer_hash(model_dir)}\0".encode())
    root = Path(data)
    for file in data_files(root):
        name = file.name if root.is_file() else str(file.relative_to(root))
        digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class TokenizedCorpus:
    """Memory-mapped documents: ids and loss masks, read without tokenizing again."""

    folder: Path
    tokens: np.ndarray     # uint32 [n_tokens]
    mask: np.ndarray       # uint8 [n_tokens]
    offsets: np.ndarray    # int64 [n_docs + 1]
    meta: dict

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "TokenizedCorpus":
        """Map a cache folder; a damaged one (truncated, altered, unreadable) is refused naming the folder."""
        folder = Path(folder)
        meta = _checked_meta(folder)
        n = meta["tokens"]
        tokens = np.memmap(folder / "tokens.bin", dtype=np.uint32, mode="r", shape=(n,)) if n else np.zeros(0, np.uint32)
        mask = np.memmap(folder / "mask.bin", dtype=np.uint8, mode="r", shape=(n,)) if n else np.zeros(0, np.uint8)
        return cls(folder, tokens, mask, np.load(folder / "offsets.npy"), meta)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def label_counts(self) -> np.ndarray:
        """Per document, its tokens past the first with mask 1 (one pass over the mask)."""
        if not self.num_docs:
            return np.zeros(0, dtype=np.int64)
        starts = self.offsets[:-1]
        return np.add.reduceat(self.mask, starts, dtype=np.int64) - self.mask[starts].astype(np.int64)

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss mask) of document i (views of the memory map)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.mask[a:b]

    def origin(self, i: int) -> str:
        with open(self.folder / "origins.txt") as f:
            for j, line in enumerate(f):
                if j == i:
                    return line.rstrip("\n")
        return f"document {i}"

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids the model cannot embed (a tokenizer that does not match the model)."""
        top = self.meta["max_id"]
        if top >= vocab_size:
            doc = int(np.searchsorted(self.offsets, int(np.argmax(np.asarray(self.tokens) >= vocab_size)), "right")) - 1
            raise ValueError(f"{self.origin(doc)}: token id {top} is beyond the model's vocabulary of {vocab_size} "
                             f"(tokenizer {self.meta['tokenizer']} does not match the model): tokenize with the "
                             f"model's own tokenizer (--model DIR holding both), or resize the embedding")


def _damaged(folder: Path, what: str) -> ValueError:
    return ValueError(f"the tokenized corpus {folder} is damaged ({what}); delete the folder (rm -r '{folder}') and "
                      f"run again to rebuild it from --data")


def _checked_meta(folder: Path) -> dict:
    """meta.json, once every array file has the size and the sha256 it was written with."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        n, sums, docs = int(meta["tokens"]), meta["sha256"], int(meta["docs"])
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise _damaged(folder, f"meta.json unreadable: {err}") from err
    sizes = {"tokens.bin": 4 * n, "mask.bin": n, "offsets.npy": None}
    for name in _ARRAYS:
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        if size is None or (sizes[name] is not None and size != sizes[name]):
            raise _damaged(folder, f"{name} is {'missing' if size is None else f'{size} bytes'}, "
                                   f"{sizes[name]} bytes expected for {n} tokens in {docs} documents")
        if file_sha256(path) != sums.get(name):
            raise _damaged(folder, f"{name} is not what was written: its sha256 differs from meta.json's")
    return meta


def tokenized_corpus(data: str | os.PathLike, model_dir: str | os.PathLike, text_field: str = "text",
                     cache_dir: str | os.PathLike | None = None, workers: int = 0, progress: bool = False,
                     wait_s: float = 600.0) -> TokenizedCorpus:
    """The corpus of `data` tokenized by `model_dir`'s tokenizer: from the cache, or built once.

    The other ranks wait for the builder as long as it makes progress: it touches its lock as
    documents come out of the tokenizer (every _BEAT_S seconds at most), and they give up after
    `wait_s` seconds without a touch (a builder that died on another host, or hangs), not after a
    fixed time (a large corpus may take hours to tokenize).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(data, model_dir, text_field)
    folder, lock, error = root / key, root / f"{key}.lock", root / f"{key}.error"
    if (folder / "meta.json").exists():
        return TokenizedCorpus.open(folder)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and _take(lock):
        try:
            error.unlink(missing_ok=True)
            _remove_stale_builds(root)
            with _sigterm_as_exit():
                _build(folder, data, model_dir, text_field, workers, progress, _Beat(lock))
        except (ValueError, TypeError, OSError) as err:
            _report(error, type(err).__name__, str(err))
            raise
        except BaseException as err:  # anything else (a broken tokenizer, ^C): the waiting ranks stop too
            _report(error, "RuntimeError", f"{type(err).__name__}: {err}")
            raise
        finally:
            lock.unlink(missing_ok=True)
        return TokenizedCorpus.open(folder)
    return _wait(folder, lock, error, wait_s)


def _take(lock: Path) -> bool:
    """Create `lock` naming this process; a dead builder's lock on this host is removed and taken."""
    for _ in range(2):  # a second try after removing a dead builder's lock
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if not _dead(lock):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
        return True
    return False


def _dead(lock: Path) -> bool:
    """Whether `lock` was written on this host by a process that no longer exists (unreadable: alive)."""
    try:
        holder = json.loads(lock.read_text())
        pid = holder["pid"] if holder["host"] == socket.gethostname() else None
    except (OSError, ValueError, TypeError, KeyError):
        return False  # being written this instant, another host's, or an older empty lock
    return isinstance(pid, int) and pid > 0 and not pid_alive(pid)


_BEAT_S = 10.0  # at most how often a builder touches its lock


class _Beat:
    """Touch `lock` when called, at most every `every_s` seconds: the builder's sign of progress."""

    def __init__(self, lock: Path, every_s: float = _BEAT_S):
        self.lock, self.every_s, self.last = lock, every_s, time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            try:
                os.utime(self.lock)
            except OSError:
                pass


def _touched(lock: Path) -> int | None:
    """The lock's modification time (ns), None when it is gone."""
    try:
        return lock.stat().st_mtime_ns
    except OSError:
        return None


def _wait(folder: Path, lock: Path, error: Path, wait_s: float) -> TokenizedCorpus:
    """Wait for the builder's folder or error; give up after `wait_s` seconds without a touch of its lock."""
    seen, since = _touched(lock), time.monotonic()
    while time.monotonic() - since < wait_s:
        if (folder / "meta.json").exists():
            return TokenizedCorpus.open(folder)
        if error.exists() and not lock.exists() and not _earlier_launch(error):
            report = error.read_text()
            kind, _, text = (report.partition("\n")[2] if report.startswith("{") else report).partition("\n")
            raise {"TypeError": TypeError, "OSError": OSError, "RuntimeError": RuntimeError}.get(kind, ValueError)(
                f"{text} (raised while tokenizing on the local rank 0; delete {error} to try again)")
        touched = _touched(lock)
        if touched != seen:  # the builder makes progress (it touches the lock as it goes)
            seen, since = touched, time.monotonic()
        time.sleep(0.1)
    raise TimeoutError(f"waited {wait_s:.0f}s for the tokenized corpus {folder} that another process builds "
                       f"(lock {lock}), without a sign of progress from it (a working builder touches the lock "
                       f"every {_BEAT_S:.0f}s); if no process is building it, delete the lock file")


def _report(error: Path, kind: str, text: str) -> None:
    """The builder's error for the waiting ranks: where and when (a JSON line), its kind, its text."""
    try:
        error.write_text(json.dumps({"host": socket.gethostname(), "time": time.time()}) + f"\n{kind}\n{text}")
    except OSError:  # a full disk: the builder's own error is raised still; the waiting ranks time out
        pass


def _earlier_launch(error: Path) -> bool:
    """Whether `error` was written on this host before this process started (so by an earlier launch)."""
    try:
        written = json.loads(error.read_text().partition("\n")[0])
        started = _started()
        return written["host"] == socket.gethostname() and started is not None and written["time"] < started - 2
    except (OSError, ValueError, TypeError, KeyError):
        return False  # being written this instant, or unreadable: taken as this launch's


def _started() -> float | None:
    """This process's start in seconds since the epoch (Linux /proc, to about a second); None elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _build(folder: Path, data, model_dir, text_field: str, workers: int, progress: bool,
           beat: Callable[[], None] = lambda: None) -> None:
    tmp = folder.with_name(f"{folder.name}{_TMP}{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write(tmp, data, model_dir, text_field, workers, progress, beat)
    except OSError as err:  # a full disk, a read-only folder: say which folder and what to do
        shutil.rmtree(tmp, ignore_errors=True)
        if err.filename is not None and not str(err.filename).startswith(str(folder.parent)):
            raise  # not the cache's own files (a data file that vanished): its own message names it
        raise OSError(err.errno, f"writing the tokenized corpus into {folder.parent} failed ({err.strerror or err}); "
                                 f"free space there, or pass --cache-dir (or set PIPEZERO_CACHE) to a folder on "
                                 f"a disk with room") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(folder)
    except OSError:  # another builder (another machine on a shared disk) was first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)


_TMP = ".tmp-"  # a build's temporary folder: <key>.tmp-<host>-<pid>


def _remove_stale_builds(root: Path) -> None:
    """Remove the temporary folders of builds on this host whose process is gone (killed with SIGKILL)."""
    host = socket.gethostname()
    for tmp in root.glob(f"*{_TMP}{host}-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """During a build, SIGTERM (a scheduler's preemption) raises SystemExit(143) in the main thread, so the
    temporary folder and the lock are removed on the way out; a handler of the caller's is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _write(tmp: Path, data, model_dir, text_field: str, workers: int, progress: bool,
           beat: Callable[[], None]) -> None:
    docs = read_documents(data, text_field)  # streamed: a bad record stops the build at its place
    offsets, top, count, trained, kinds = [0], 0, 0, 0, set()
    sums = {name: hashlib.sha256() for name in _ARRAYS}
    with open(tmp / "tokens.bin", "wb") as ft, open(tmp / "mask.bin", "wb") as fm, \
            open(tmp / "origins.txt", "w") as fo:
        for doc, (ids, mask) in _progress(encode_many(model_dir, docs, workers), progress):
            beat()
            if len(ids) < 2:
                raise ValueError(f"{doc.origin}: tokenizes to {len(ids)} token, too short to train on (a token "
                                 f"and its next one); drop the record or give it more text")
            if ids.min() < 0 or ids.max() >= 2**32:
                raise ValueError(f"{doc.origin}: token ids outside [0, 2**32); the tokenizer is broken")
            for f, name, raw in ((ft, "tokens.bin", ids.astype(np.uint32).tobytes()),
                                 (fm, "mask.bin", mask.astype(np.uint8).tobytes())):
                f.write(raw)
                sums[name].update(raw)
            fo.write(doc.origin.replace("\n", " ") + "\n")
            count, trained = count + len(ids), trained + int(mask.sum())
            offsets.append(count)
            top = max(top, int(ids.max()))
            kinds.add(doc.kind)
    np.save(tmp / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    sums["offsets.npy"] = hashlib.sha256((tmp / "offsets.npy").read_bytes())
    meta = {"version": _VERSION, "data": str(data), "tokenizer": str(model_dir), "text_field": text_field,
            "docs": len(offsets) - 1, "tokens": count, "max_id": top,
            "trained_tokens": trained, "kinds": sorted(kinds),
            "sha256": {name: digest.hexdigest() for name, digest in sums.items()}}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _progress(items: Iterable, show: bool) -> Iterable:
    if not show:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="tokenizing", unit="doc")
