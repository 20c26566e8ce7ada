"""Which rank and chunk hold each virtual stage.

With `num_chunks` virtual chunks per rank a model of `num_stages * num_chunks` virtual
stages is laid out either *looped* (interleaved 1F1B: rank r holds stages r, r+p, r+2p, ...)
or *v*-shaped (ZeroBubbleV: rank r holds stages r and 2p-1-r, so the first and the last
virtual stage sit on rank 0).
"""

from __future__ import annotations

PLACEMENTS = ("looped", "v")


def virtual_stage(rank: int, chunk: int, num_stages: int, placement: str = "looped") -> int:
    """The virtual stage index that `chunk` on pipeline `rank` holds."""
    _check(placement)
    if placement == "v" and chunk % 2 == 1:
        return chunk * num_stages + (num_stages - 1 - rank)
    return chunk * num_stages + rank


def owner(stage: int, num_stages: int, placement: str = "looped") -> tuple[int, int]:
    """(rank, chunk) that holds virtual `stage`; the inverse of virtual_stage."""
    _check(placement)
    chunk, offset = divmod(stage, num_stages)
    if placement == "v" and chunk % 2 == 1:
        return num_stages - 1 - offset, chunk
    return offset, chunk


def _check(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {PLACEMENTS}")
