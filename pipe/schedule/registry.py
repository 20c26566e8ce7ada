"""The schedule registry: one table name -> schedule class, read by the config, the CLI and the examples.

A schedule added here appears at once in ds_config's `pipeline.schedule`, in
`pipezero simulate --schedule` and in `train_gpt.py --schedule`, with its default chunk
count and placement taken from the class, so the tools cannot disagree about them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipezero.checks import is_int
from pipezero.pipe.schedule.schedules import DualPipeV, GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1, ZeroBubbleV

__all__ = ["SCHEDULES", "ScheduleEntry", "make_schedule", "schedule_entry", "schedule_names"]


@dataclass(frozen=True)
class ScheduleEntry:
    """One registered schedule: its name, class and the other names it answers to."""

    name: str
    cls: type
    aliases: tuple[str, ...] = ()

    @property
    def chunks(self) -> int:
        """Virtual chunks per rank when none are asked for (the class's own default)."""
        return self.cls.num_chunks

    @property
    def placement(self) -> str:
        """How chunks map to virtual stages: "looped" or "v" (pipe/schedule/placement.py)."""
        return self.cls.placement

    @property
    def variable_chunks(self) -> bool:
        """Whether the chunk count is a parameter (interleaved 1F1B) or fixed by the schedule."""
        return any(f.name == "num_chunks" for f in dataclasses.fields(self.cls))

    def make(self, num_microbatches: int, chunks: int | None = None) -> Any:
        """The schedule object for `num_microbatches` (and `chunks`, where they vary)."""
        chunks = self.check_chunks(chunks)
        if self.variable_chunks:
            return self.cls(num_microbatches=num_microbatches, num_chunks=chunks)
        return self.cls(num_microbatches=num_microbatches)

    def check_chunks(self, chunks: int | None) -> int:
        """`chunks`, or the default when None; a ValueError when this schedule cannot use them."""
        if chunks is None:
            return self.chunks
        if self.variable_chunks:
            if not is_int(chunks, minimum=2):
                raise ValueError(f'schedule "{self.name}" takes chunks >= 2 per rank, got {chunks!r}')
        elif chunks != self.chunks:
            raise ValueError(f'schedule "{self.name}" runs {self.chunks} chunk(s) per rank, got chunks={chunks!r}; '
                             'leave chunks out, or use "interleaved_1f1b" for other chunk counts')
        return chunks


SCHEDULES: dict[str, ScheduleEntry] = {e.name: e for e in (
    ScheduleEntry("gpipe", GPipe),
    ScheduleEntry("1f1b", OneFOneB, ("onefoneb",)),
    ScheduleEntry("interleaved_1f1b", Interleaved1F1B, ("interleaved1f1b",)),
    ScheduleEntry("zb_h1", ZeroBubbleH1, ("zerobubbleh1", "zbh1")),
    ScheduleEntry("zbv", ZeroBubbleV, ("zerobubblev", "zb_v")),
    ScheduleEntry("dualpipev", DualPipeV, ("dualpipe_v",)),
)}
_LOOKUP = {alias: e for e in SCHEDULES.values() for alias in (e.name, *e.aliases)}


def schedule_names() -> list[str]:
    """The registered names, in the table's order (simplest first)."""
    return list(SCHEDULES)


def schedule_entry(name: str) -> ScheduleEntry:
    """The entry for a name or alias (case-insensitive; a class name works too)."""
    entry = _LOOKUP.get(name.lower()) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown pipeline schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    return entry


def make_schedule(name: str, num_microbatches: int, chunks: int | None = None) -> Any:
    """The schedule object a name asks for: `make_schedule("interleaved_1f1b", 8, chunks=2)`."""
    return schedule_entry(name).make(num_microbatches, chunks)
