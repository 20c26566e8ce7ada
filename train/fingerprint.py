"""Short hashes of what a resumed fine-tune must not change underneath it: the model's weights.

A checkpoint records them (load_state's `model_config`), so a rerun pointed at another model of
the same shapes (a sibling fine-tune of the same base) is refused with both values instead of the
checkpoint's weights silently replacing the model the user named. Cheap at any size: each weight
file's name, size, and 16 evenly spaced windows of 64 KiB of its bytes (a safetensors header
included), so a different fine-tune differs in every window while a moved or copied directory
does not. The data's fingerprint is its tokenized cache's name (train/data/cache.py's
`cache_key`: the sha256 of the files and the tokenizer).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["weights_fingerprint"]

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
_WINDOWS, _WINDOW = 16, 1 << 16


def weights_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 (16 hex digits) over the weight files of a save_pretrained directory, sampled."""
    root = Path(model_dir)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _WEIGHTS) if root.is_dir() else []
    if not files:
        return "no weight files"  # a config alone: the model starts from random weights
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for k in range(_WINDOWS):
                f.seek(size * k // _WINDOWS)
                digest.update(f.read(_WINDOW))
    return digest.hexdigest()[:16]
