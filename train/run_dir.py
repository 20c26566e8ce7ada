"""One job per run directory: a lock file naming the job that holds it, and whether its export is done.

Two jobs writing checkpoints into the same --out overwrite each other's steps (or collide on a
checkpoint's temporary folder), so the first rank 0 to arrive writes `<out>/pipezero.lock`
(created exclusively: its pid, host, start time and command line) and every other job is refused
with that job's pid and host and what to do. Rank 0 decides and every rank raises the same error
(one broadcast), so no rank of the refused job is left waiting. A lock left by a job that died
(its pid gone from this host) is taken over; one from another host is refused, since its
liveness cannot be checked from here. The same process may claim its own directory again (a
test running main() twice); the lock goes when the job ends, or at exit.

A job stopped between its last checkpoint and its export leaves a finished run without a model:
`export_done` tells a rerun so (summary.json, written last, names the step exported), and
`record_loss` keeps each checkpointed step's loss beside it for the summary written then.

    with claim_run_dir(args.out, grid):
        ...  # resume, train, save, export
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

__all__ = ["LOCK_NAME", "claim_run_dir", "export_done", "pid_alive", "record_loss", "recorded_loss"]

LOCK_NAME = "pipezero.lock"


@contextmanager
def claim_run_dir(out: str | os.PathLike, grid: Any = None) -> Iterator[Path]:
    """Hold `out` for this job inside the block (rank 0 writes the lock; every rank learns the verdict)."""
    path = Path(out) / LOCK_NAME
    rank = grid.rank if grid is not None else 0
    problem = _take(path) if rank == 0 else None
    problem = _agree(problem)
    if problem is not None:
        raise ValueError(problem)
    release = (lambda: _release(path)) if rank == 0 else (lambda: None)
    atexit.register(release)
    try:
        yield path
    finally:
        release()
        atexit.unregister(release)


def export_done(out: str | os.PathLike, step: int, files: tuple[str, ...] = ("model.safetensors",)) -> bool:
    """Whether `out` holds the export of step `step`: its files (a .safetensors one readable: a truncated or
    damaged export is written again), and a summary.json (written last) for that step."""
    out = Path(out)
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return summary.get("steps") == step and all(_readable(out / f) for f in files)


def _readable(path: Path) -> bool:
    if path.suffix != ".safetensors":
        return path.is_file()
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt"):  # the header, and that it covers the file
            return True
    except Exception:  # noqa: BLE001 - SafetensorError, OSError: not a usable export either way
        return False


def record_loss(out: str | os.PathLike, step: int, loss: float) -> None:
    """Note the training loss of a checkpointed step (rank 0, after the save), for an export written later."""
    path = Path(out) / "progress.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "loss": loss}))
    os.replace(tmp, path)


def recorded_loss(out: str | os.PathLike, step: int) -> float | None:
    """The loss record_loss noted for `step` (None when none was noted for that step)."""
    try:
        progress = json.loads((Path(out) / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return progress.get("loss") if isinstance(progress, dict) and progress.get("step") == step else None


def _take(path: Path) -> str | None:
    """None when this process now holds the lock, else the refusal naming the holder."""
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"--out {str(path.parent)!r} cannot be created ({err.strerror or err}); pass a writable --out"
    for _ in range(2):  # a second try after removing a dead job's lock
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder.get("host") == mine["host"] and holder.get("pid") == mine["pid"]:
                return None  # this process already holds it
            if holder.get("host") == mine["host"] and not pid_alive(holder.get("pid")):
                path.unlink(missing_ok=True)  # its job died without releasing it
                continue
            return _refusal(path, holder, mine["host"])
        except OSError as err:
            return f"cannot write the run lock {str(path)!r} ({err.strerror or err}); pass a writable --out"
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return None
    return f"cannot take the run lock {str(path)!r}: another job took it at the same moment; pass another --out"


def _refusal(path: Path, holder: dict, host: str) -> str:
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    since = f", started {holder['started']}" if holder.get("started") else ""
    command = f" ({' '.join(holder['argv'])})" if holder.get("argv") else ""
    gone = (f"; if that job is gone (its pid may now be another process's), delete {path}" if holder.get("host") == host
            else f"; if that job is gone (its host cannot be checked from {host}), delete {path}")
    return (f"--out {str(path.parent)!r} is in use by another job: {who}{since}{command}, holding {path}. Two jobs "
            f"in one run directory overwrite each other's checkpoints: wait for it to finish, or pass another "
            f"--out{gone}")


def _holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # being written this instant, or damaged: refused, naming the file


def pid_alive(pid: Any) -> bool:
    """Whether process `pid` of this host runs (True when unknown or not ours to signal)."""
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: do not take it over
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _release(path: Path) -> None:
    """Remove the lock if this process holds it."""
    holder = _holder(path)
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def _agree(problem: str | None) -> str | None:
    """Rank 0's verdict on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]
