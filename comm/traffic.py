"""Traffic accounting: bytes, calls and seconds per operation kind and group.

Always on: one dict update per collective. Bytes are payload bytes (the tensor sizes
handed to the collective), not the bytes a ring algorithm puts on the wire.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class Traffic:
    """Counters of communication, read as a plain dict with snapshot()."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, float]] = defaultdict(lambda: {"bytes": 0, "calls": 0, "seconds": 0.0})
        self._by_group: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, kind: str, nbytes: int, seconds: float = 0.0, group: str = "world") -> None:
        """Count one operation of `kind` moving `nbytes` over `group`."""
        entry = self._counts[kind]
        entry["bytes"] += nbytes
        entry["calls"] += 1
        entry["seconds"] += seconds
        self._by_group[(kind, group)] += nbytes

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Add time spent waiting on an asynchronous `kind` operation."""
        self._counts[kind]["seconds"] += seconds

    @contextmanager
    def timed(self, kind: str, nbytes: int, group: str = "world"):
        """Count an operation and the time spent inside the block."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, nbytes, time.perf_counter() - start, group)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{kind: {"bytes", "calls", "seconds"}}."""
        return {kind: dict(v) for kind, v in self._counts.items()}

    def by_group(self) -> dict[str, int]:
        """{"kind@group": bytes}."""
        return {f"{k}@{g}": b for (k, g), b in self._by_group.items()}

    def reset(self) -> None:
        self._counts.clear()
        self._by_group.clear()


TRAFFIC = Traffic()  # the process-wide counters every comm function writes to


def group_name(group) -> str:
    """A short stable name for a process group, e.g. 'world' or 'ranks[0,2]'."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return "world"
    ranks = dist.get_process_group_ranks(group)
    return "ranks[" + ",".join(map(str, ranks)) + "]"
