"""Checkpoints that survive crashes and load onto another grid: safetensors per rank + a JSON manifest.

Layout of `dir` (every name below is ours; nothing is ever unpickled):

    latest                      name of the newest complete checkpoint, replaced last
    step_00000100/manifest.json format version, step, grid, world, meta, and per rank file its
                                bytes, sha256 and tensor names/dtypes/shapes
    step_00000100/rank_00000.safetensors  ...one per rank

A save writes into `.tmp-step_...`, which only becomes `step_...` by one rename once every
rank's file and the manifest are on disk; `latest` is swapped after that. A crash at any
point leaves the previous checkpoint and `latest` as they were, and the half-written
directory is never read (the next save of that step clears it). Re-saving the step that
`latest` names moves the old folder to `.old-step_...` before the new one is renamed in; a
crash between the two renames leaves `latest` naming a missing folder, so loading follows it
to `.old-step_...` (complete) and the next save moves that back. The manifest carries its own
sha256 and its step must match the folder name and `meta["step"]`: an edited manifest is
refused, never trusted. `_reach(point)` marks each write and rename of the protocol, for tests
that kill the process there (PIPEZERO_CHECKPOINT_KILL_AT=<point>).

State is keyed by GLOBAL names (e.g. a parameter's name in the single-process model, or
"optim.exp_avg/layers.3.qkv.weight"), not by rank or flat buffer, so a checkpoint saved on
one grid loads onto another: `load_checkpoint` merges the rank files into one name -> tensor
dict (optionally only the names a rank needs) and each rank takes its part.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = ["FORMAT_VERSION", "Checkpoint", "CheckpointError", "checkpoint_meta", "checkpoint_names",
           "export_consolidated", "file_sha256", "has_checkpoint", "latest_step", "load_checkpoint",
           "prune_checkpoints", "save_checkpoint", "step_dir_name"]

FORMAT_VERSION = 2  # 2: the manifest carries its own sha256
_MANIFEST, _LATEST = "manifest.json", "latest"
SAVE_POINTS = ("mkdir", "write_rank", "write_entry", "write_manifest", "rename_manifest", "move_old",
               "rename", "drop_old", "write_latest", "rename_latest")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupted, truncated or does not fit the model."""


class Checkpoint(NamedTuple):
    """A loaded checkpoint: merged tensors by global name, the saver's meta, step and directory."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    step: int
    path: Path


def step_dir_name(step: int) -> str:
    """The directory name of one step's checkpoint."""
    return f"step_{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# -- save ---------------------------------------------------------------------------------------

def save_checkpoint(directory: str | os.PathLike, step: int, tensors: Mapping[str, torch.Tensor],
                    meta: Mapping[str, Any], rank: int = 0, world: int = 1,
                    grid: Mapping[str, int] | None = None, group: Any = None, latest: bool = True) -> Path:
    """Write this rank's tensors; rank 0 seals the checkpoint once every rank's file is written.

    Call on every rank (with world > 1 it synchronises through barriers on `group`). `meta`
    must be JSON (step counters, data position, lr schedule...); RNG states and anything else
    that is an array go into `tensors`. `latest=False` leaves the `latest` pointer as it was
    (DeepSpeed's save_latest). Returns the final checkpoint directory.
    """
    _check_save_args(step, tensors, meta, rank, world)
    root = Path(directory)
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}"
    _agree(_attempt(lambda: _start_save(root, tmp)) if rank == 0 else None, world, group, name)
    _agree(_attempt(lambda: _write_entry(tmp, rank, tensors)), world, group, name)
    sealed = _attempt(lambda: _seal(root, tmp, name, step, world, dict(meta), dict(grid or {}), latest)) \
        if rank == 0 else None
    _agree(sealed, world, group, name)
    return root / name


def _start_save(root: Path, tmp: Path) -> None:
    """Rank 0: put back a re-save's old folder that a crash left aside, clear an old temp dir."""
    _repair(root)
    shutil.rmtree(tmp, ignore_errors=True)
    _reach("mkdir")
    tmp.mkdir(parents=True)


def _write_entry(tmp: Path, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
    entry = _write_rank(tmp, rank, tensors)
    _reach("write_entry")
    (tmp / f"rank_{rank:05d}.json").write_text(json.dumps(entry))


def _attempt(fn: Callable[[], Any]) -> str | None:
    """Run one part of a save; an OSError (disk full, read-only) becomes a message for every rank."""
    try:
        fn()
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        hint = " (disk full: free space or save elsewhere)" if err.errno == errno.ENOSPC else \
            " (read-only: save elsewhere with --out)" if err.errno == errno.EROFS else ""
        return f"{where}{err.strerror or err}{hint}"
    return None


def _agree(problem: str | None, world: int, group: Any, name: str) -> None:
    """Every rank learns whether any rank failed (replaces a barrier: no rank waits forever)."""
    problems = [problem]
    if world > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"save_checkpoint(world={world}) needs an initialised process group")
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        text = "; ".join(f"rank {r}: {p}" for r, p in failed)
        raise OSError(f"saving checkpoint {name} failed ({text}); the previous checkpoint and "
                      f"'{_LATEST}' are unchanged")


def _check_save_args(step: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                     rank: int, world: int) -> None:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint(step={step!r}): expected an integer >= 0")
    if not 0 <= rank < world:
        raise ValueError(f"save_checkpoint(rank={rank}, world={world}): expected 0 <= rank < world")
    for key, value in tensors.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(f"save_checkpoint: tensors[{key!r}] must map a str to a Tensor, "
                            f"got {type(value).__name__}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise TypeError(f"save_checkpoint: meta must be plain JSON ({err}); put arrays and RNG "
                        f"states into `tensors` instead") from None


def _cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU copies; safetensors refuses tensors that share memory, so clone those."""
    out, seen = {}, set()
    for key, value in tensors.items():
        t = value.detach().cpu()
        if not t.is_contiguous() or t.untyped_storage().data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _write_rank(tmp: Path, rank: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write one rank file, fsync it, and describe it (size, sha256, tensors) for the manifest."""
    path = tmp / _rank_file(rank)
    cpu = _cpu_tensors(tensors)
    _reach("write_rank")
    try:
        save_file(cpu, str(path), metadata={"format": f"pipezero-checkpoint-v{FORMAT_VERSION}", "rank": str(rank)})
        _fsync(path)
    except OSError as err:
        raise OSError(err.errno, err.strerror or str(err), str(path)) from None
    except SafetensorError as err:  # safetensors reports a failed write as its own error type
        raise OSError(errno.EIO, str(err), str(path)) from None
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "tensors": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                        for k, v in cpu.items()}}


def _seal(root: Path, tmp: Path, name: str, step: int, world: int, meta: dict, grid: dict,
          latest: bool = True) -> None:
    """Rank 0: manifest, one rename of the directory, then the `latest` pointer."""
    files = []
    for r in range(world):
        part = tmp / f"rank_{r:05d}.json"
        files.append(json.loads(part.read_text()))
        part.unlink()
    manifest = {"format_version": FORMAT_VERSION, "step": step, "world": world, "grid": grid,
                "meta": meta, "files": files}
    manifest["sha256"] = _manifest_digest(manifest)
    _atomic_write(tmp / _MANIFEST, json.dumps(manifest, indent=1), "manifest")
    final = root / name
    if final.exists():  # re-saving a step: move the old one aside, swap, then drop it
        old = root / f".old-{name}"
        shutil.rmtree(old, ignore_errors=True)
        _reach("move_old")
        os.replace(final, old)
        _reach("rename")
        os.replace(tmp, final)
        _reach("drop_old")
        shutil.rmtree(old, ignore_errors=True)
    else:
        _reach("rename")
        os.replace(tmp, final)
    _fsync_dir(root)
    if latest:
        _atomic_write(root / _LATEST, name + "\n", "latest")


def _repair(root: Path) -> None:
    """Undo what a crash between a re-save's two renames left: `latest`'s folder is `.old-`."""
    latest = root / _LATEST
    if not latest.is_file():
        return
    name = latest.read_text().strip()
    old = root / f".old-{name}"
    if name.startswith("step_") and not (root / name).exists() and (old / _MANIFEST).is_file():
        os.replace(old, root / name)


def _reach(point: str) -> None:
    """A named write or rename of the save protocol (SAVE_POINTS); a test can kill the process here."""
    if os.environ.get("PIPEZERO_CHECKPOINT_KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _atomic_write(path: Path, text: str, point: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    _reach(f"write_{point}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _reach(f"rename_{point}")
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks (checkpoint files and the token cache)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- load ---------------------------------------------------------------------------------------

def load_checkpoint(directory: str | os.PathLike, step: int | None = None,
                    names: Iterable[str] | Callable[[str], bool] | None = None,
                    expected: Mapping[str, torch.Tensor | torch.Size | tuple] | None = None,
                    strict: bool = True) -> Checkpoint:
    """Verify every rank file of a checkpoint and return its tensors merged by global name.

    `directory` is the checkpoint root (its `latest` is followed unless `step` is given) or one
    step's directory. `names` (a set or a predicate) loads only those tensors. `expected`
    (name -> tensor or shape) refuses a checkpoint whose names or shapes do not fit the model;
    with strict=False, names the checkpoint has but `expected` lacks are allowed.
    A name saved by several ranks must be the same tensor there; the lowest rank's copy is used.
    """
    path = _resolve(Path(directory), step)
    manifest = _read_manifest(path)
    wanted = _name_filter(names)
    merged: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for entry in manifest["files"]:
        file = _verify_file(path, entry)
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            if keys != set(entry["tensors"]):
                raise CheckpointError(f"{file}: holds tensors {sorted(keys ^ set(entry['tensors']))[:5]} "
                                      f"that differ from its manifest entry; the file was replaced")
            for key in sorted(keys):
                if key in merged or not wanted(key):
                    continue
                merged[key], where[key] = f.get_tensor(key), file.name
    if expected is not None:
        _check_fits(path, manifest, merged, where, expected, strict, wanted)
    return Checkpoint(merged, manifest["meta"], int(manifest["step"]), path)


def checkpoint_meta(directory: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """The saver's meta of a checkpoint (the latest unless `step`) from its manifest alone, no tensor read.

    For what must be decided before the parts exist, e.g. the batch sizes of a resumed run.
    """
    return dict(_read_manifest(_resolve(Path(directory), step))["meta"])


def checkpoint_names(directory: str | os.PathLike, step: int | None = None) -> set[str]:
    """The tensor names of a checkpoint (the latest unless `step`), every rank file's, from its manifest alone."""
    return {k for entry in _read_manifest(_resolve(Path(directory), step))["files"] for k in entry["tensors"]}


def _resolve(root: Path, step: int | None) -> Path:
    if step is not None:
        return _or_old_copy(root, step_dir_name(step))
    if (root / _MANIFEST).exists():
        return root
    latest = root / _LATEST
    if not latest.is_file():
        raise CheckpointError(f"{root}: no checkpoint here (no '{_LATEST}' pointer and no {_MANIFEST}); "
                              f"pass the directory save_checkpoint wrote to")
    name = latest.read_text().strip()
    if not name.startswith("step_") or "/" in name:
        raise CheckpointError(f"{latest}: holds {name!r}, not a checkpoint name like 'step_00000100'; "
                              f"{_recovery(latest)}")
    return _or_old_copy(root, name)


def _or_old_copy(root: Path, name: str) -> Path:
    """The step's folder, or its `.old-` copy when a re-save was cut between its two renames."""
    old = root / f".old-{name}"
    if not (root / name / _MANIFEST).is_file() and (old / _MANIFEST).is_file():
        return old
    return root / name


def _read_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of `path`; a CheckpointError naming another complete step to resume from."""
    try:
        return _parse_manifest(path)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; {_recovery(path)}") from None


def _recovery(path: Path) -> str:
    """What to do about the damaged checkpoint `path`: resume from the newest other one whose manifest
    reads (named, as the jobs' flag takes it), or start afresh."""
    root, bad = path.parent, path.name.removeprefix(".old-")
    for other in sorted(root.glob("step_*"), reverse=True):
        if other.name == bad:
            continue
        try:
            _parse_manifest(other)
        except CheckpointError:
            continue
        return f"load another step: --resume-from {other.name} (the newest complete one in {root})"
    return f"no other complete checkpoint in {root}: start afresh with another --out (or delete {root})"


def _parse_manifest(path: Path) -> dict[str, Any]:
    file = path / _MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err}); the manifest is corrupted") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format_version {version!r}, this pipezero reads {FORMAT_VERSION}; "
                              "load it with the pipezero that wrote it, or start afresh in another directory")
    for key in ("step", "world", "meta", "files", "sha256"):
        if key not in manifest:
            raise CheckpointError(f"{file}: lacks the key {key!r}; the manifest is corrupted")
    if manifest["sha256"] != _manifest_digest(manifest):
        raise CheckpointError(f"{file}: its sha256 does not match its contents: the manifest was edited or "
                              f"corrupted")
    _check_manifest_fields(file, path, manifest)
    return manifest


def _check_manifest_fields(file: Path, path: Path, manifest: Mapping[str, Any]) -> None:
    """The step agrees with the folder name and meta; the file list with the world size."""
    step, meta = manifest["step"], manifest["meta"]
    folder = path.name.removeprefix(".old-")
    if not isinstance(step, int) or (folder.startswith("step_") and folder != step_dir_name(step)):
        raise CheckpointError(f"{file}: says step {step!r} but lies in {path.name}; the manifest is corrupted")
    if isinstance(meta, dict) and "step" in meta and meta["step"] != step:
        raise CheckpointError(f"{file}: says step {step} but its meta says step {meta['step']}; "
                              "the manifest is corrupted")
    files = manifest["files"]
    if not isinstance(files, list) or len(files) != manifest["world"]:
        raise CheckpointError(f"{file}: lists {len(files) if isinstance(files, list) else files!r} rank files "
                              f"for world {manifest['world']!r}; the manifest is corrupted")


def _verify_file(path: Path, entry: Mapping[str, Any]) -> Path:
    file = path / entry["file"]
    if not file.is_file():
        raise CheckpointError(f"{file}: missing rank file (the manifest lists it); the checkpoint is "
                              f"incomplete; {_recovery(path)}")
    size = file.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry['bytes']}: the file is "
                              f"{'truncated' if size < entry['bytes'] else 'longer than written'}; {_recovery(path)}")
    digest = file_sha256(file)
    if digest != entry["sha256"]:
        raise CheckpointError(f"{file}: bad checksum, sha256 {digest[:16]}... but the manifest says "
                              f"{entry['sha256'][:16]}...: the file is corrupted; {_recovery(path)}")
    return file


def _name_filter(names: Iterable[str] | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if names is None:
        return lambda key: True
    if callable(names):
        return names
    chosen = set(names)
    return chosen.__contains__


def _check_fits(path: Path, manifest: Mapping[str, Any], merged: Mapping[str, torch.Tensor],
                where: Mapping[str, str], expected: Mapping[str, Any], strict: bool,
                wanted: Callable[[str], bool]) -> None:
    """Refuse a checkpoint of another model: missing, unexpected or reshaped names."""
    saved = {k for e in manifest["files"] for k in e["tensors"] if wanted(k)}
    missing = sorted(k for k in expected if wanted(k) and k not in saved)
    unexpected = sorted(saved - set(expected)) if strict else []
    if missing or unexpected:
        raise CheckpointError(f"{path}: does not fit the model: missing {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
                              f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})")
    for key, want in expected.items():
        if key in merged:
            shape = tuple(want.shape if isinstance(want, torch.Tensor) else want)
            if tuple(merged[key].shape) != shape:
                raise CheckpointError(f"{path / where[key]}: tensor {key!r} has shape "
                                      f"{tuple(merged[key].shape)} but the model wants {shape}: "
                                      f"a checkpoint of another model")


def has_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether load_checkpoint(directory) has something to follow: a `latest` pointer, or one step's manifest."""
    root = Path(directory)
    return (root / _LATEST).is_file() or (root / _MANIFEST).is_file()


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step `latest` points to, or None when no checkpoint was ever completed there (start fresh)."""
    latest = Path(directory) / _LATEST
    if not latest.is_file():
        return None
    return int(_resolve(Path(directory), None).name.removeprefix(".old-").removeprefix("step_"))


def prune_checkpoints(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (never the one `latest` names); rank 0 only."""
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"prune_checkpoints(keep={keep!r}): expected an integer >= 1")
    root = Path(directory)
    current = latest_step(root)
    steps = sorted((p for p in root.glob("step_*") if (p / _MANIFEST).is_file()), reverse=True)
    doomed = [p for p in steps[keep:] if current is None or p.name != step_dir_name(current)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# -- export -------------------------------------------------------------------------------------

def export_consolidated(path: str | os.PathLike, state_dict: Mapping[str, torch.Tensor],
                        metadata: Mapping[str, str] | None = None) -> Path:
    """One safetensors file of a whole model that `load_file` + `load_state_dict` restore.

    Tied parameters (one tensor under two names) are written once per name, so a strict
    `load_state_dict` finds every key. Written to a temporary name and renamed.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tensors = _cpu_tensors({k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)})
    save_file(tensors, str(tmp), metadata={"format": "pt", **dict(metadata or {})})
    _fsync(tmp)
    os.replace(tmp, path)
    return path
