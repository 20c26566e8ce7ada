"""Checkpoint faults: nothing is lost and `latest` always loads.

Every manifest field edited or removed, files truncated, bit-flipped or missing, a process
SIGKILLed at every write and rename of a save and of a re-save of the step `latest` names
(train/checkpoint/files.py's PIPEZERO_CHECKPOINT_KILL_AT hook, in a forked child), a full disk and a
read-only folder: each is refused with a CheckpointError/OSError naming the file, and the
checkpoints that were complete before stay loadable.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from pipezero.train.checkpoint import files as ck
from pipezero.train.checkpoint.files import SAVE_POINTS, CheckpointError, load_checkpoint, save_checkpoint


def _state(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), float(version)), "n": torch.arange(5) + version}


def _saved(root: Path, *steps: int) -> Path:
    for step in steps:
        save_checkpoint(root, step, _state(step), {"step": step, "data": {"epoch": 0, "step": step}})
    return root


def _version(root: Path, step: int | None = None) -> int:
    got = load_checkpoint(root, step=step)
    return int(got.tensors["w"][0, 0])


# -- the manifest -----------------------------------------------------------------------------------
EDITS = {
    "format_version": 1, "step": 1, "world": 2, "grid": {"pipe": 2}, "meta": {"step": 2, "x": 1},
    "files": [], "sha256": "0" * 64,
    "files.0.file": "rank_00001.safetensors", "files.0.bytes": 1, "files.0.sha256": "f" * 64,
    "files.0.tensors": {"w": {"dtype": "float32", "shape": [4, 3]}}, "meta.step": 1, "meta.data": {"step": 99},
}


def _edit(manifest: dict, key: str, value) -> None:
    *path, last = key.split(".")
    node = manifest
    for part in path:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value


@pytest.mark.parametrize("key", sorted(EDITS))
def test_every_manifest_field_edited_is_refused(tmp_path, key):
    root = _saved(tmp_path, 1, 2)
    path = root / "step_00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    _edit(manifest, key, EDITS[key])
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_checkpoint(root)
    assert _version(root, step=1) == 1  # nothing lost


@pytest.mark.parametrize("key", ["format_version", "step", "world", "meta", "files", "sha256"])
def test_every_manifest_field_removed_is_refused(tmp_path, key):
    root = _saved(tmp_path, 1, 2)
    path = root / "step_00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest[key]
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_checkpoint(root)


def test_step_edited_with_a_fresh_checksum_is_refused(tmp_path):
    """Issue 16 item 1: a manifest that says step 1 inside step_00000002 would resume at the wrong
    step and, once saved over, prune the real checkpoints."""
    root = _saved(tmp_path, 1, 2)
    path = root / "step_00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["step"] = 1
    manifest["sha256"] = ck._manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="says step 1 but lies in step_00000002"):
        load_checkpoint(root)


# -- the files --------------------------------------------------------------------------------------
def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "rank file truncated": (lambda d: (d / "rank_00000.safetensors").write_bytes(
        (d / "rank_00000.safetensors").read_bytes()[:-7]), "truncated"),
    "rank file emptied": (lambda d: (d / "rank_00000.safetensors").write_bytes(b""), "truncated"),
    "rank file bit flip in the header": (lambda d: _flip(d / "rank_00000.safetensors", 20), "checksum"),
    "rank file bit flip in the data": (lambda d: _flip(d / "rank_00000.safetensors", -3), "checksum"),
    "rank file missing": (lambda d: (d / "rank_00000.safetensors").unlink(), "missing rank file"),
    "manifest truncated": (lambda d: (d / "manifest.json").write_text((d / "manifest.json").read_text()[:40]),
                           "not valid JSON"),
    "manifest bit flip": (lambda d: _flip(d / "manifest.json", 200), "manifest"),
    "manifest missing": (lambda d: (d / "manifest.json").unlink(), "missing"),
    "folder missing": (lambda d: [p.unlink() for p in d.iterdir()] and d.rmdir(), "missing"),
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damaged_files_are_refused_naming_the_file(tmp_path, name):
    root = _saved(tmp_path, 1, 2)
    damage, words = DAMAGE[name]
    damage(root / "step_00000002")
    with pytest.raises(CheckpointError, match=words):
        load_checkpoint(root)
    assert _version(root, step=1) == 1


@pytest.mark.parametrize("text", ["", "step_00000009\n", "../step_00000001\n", "garbage"])
def test_bad_latest_pointer_is_refused(tmp_path, text):
    root = _saved(tmp_path, 1)
    (root / "latest").write_text(text)
    with pytest.raises(CheckpointError, match="step_00000009|latest"):
        load_checkpoint(root)
    assert _version(root, step=1) == 1


# -- SIGKILL at every write and rename ----------------------------------------------------------------
def _killed_save(root: Path, step: int, version: int, point: str) -> bool:
    """Save in a forked child that SIGKILLs itself at `point`; True when it died there."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest teardown, no atexit
        os.environ["PIPEZERO_CHECKPOINT_KILL_AT"] = point
        try:
            save_checkpoint(root, step, _state(version), {"step": step})
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("point", SAVE_POINTS)
@pytest.mark.parametrize("resave", [False, True], ids=["save", "resave"])
def test_sigkill_anywhere_in_a_save_loses_nothing(tmp_path, point, resave):
    root = _saved(tmp_path, 1, 2)
    step, version = (2, 20) if resave else (3, 3)
    killed = _killed_save(root, step, version, point)
    assert killed == (resave or point not in ("move_old", "drop_old")), "the kill point was not reached"
    got = load_checkpoint(root)  # `latest` always loads
    assert (got.step, _version(root)) in {(2, 2), (2, 20)} if resave else {(2, 2), (3, 3)}
    assert _version(root, step=1) == 1
    if not resave and got.step == 2:
        assert _version(root, step=2) == 2
    save_checkpoint(root, step, _state(version), {"step": step})  # the next save repairs and succeeds
    assert _version(root) == version and load_checkpoint(root).step == step
    leftovers = [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-")) or p.suffix == ".tmp"]
    assert leftovers == []


# -- disk full, read-only ------------------------------------------------------------------------------
def test_disk_full_names_the_file_and_keeps_latest(tmp_path, monkeypatch):
    root = _saved(tmp_path, 1)

    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(OSError, match=r"rank_00000\.safetensors.*disk full.*unchanged"):
        save_checkpoint(root, 2, _state(2), {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(root).step == 1 and _version(root) == 1


def test_read_only_folder_is_refused_and_keeps_latest(tmp_path, monkeypatch):
    root = _saved(tmp_path, 1)
    real = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name.startswith(".tmp-"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(OSError, match=r"\.tmp-step_00000002.*read-only"):
        save_checkpoint(root, 2, _state(2), {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(root).step == 1
