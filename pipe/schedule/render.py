"""Show a schedule: a step x rank text grid, a chrome://tracing timeline, a PNG.

The text grid uses torch-style cells ("0F3" = chunk 0, forward, microbatch 3) and is what
ScheduleError prints; `Custom.from_text` reads it back.  The picture draws one row per rank
with a box per action (F, B, I, W in distinct colours, later chunks lighter), rank labels, a
time axis and a legend, for a file or for TensorBoard's `add_image(..., dataformats="HWC")`.
The boxes are numpy; pillow (a required dependency) draws the text, in its built-in bitmap
font (the same pixels on every machine), and writes the PNG.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipezero.pipe.schedule.actions import Action, Op

if TYPE_CHECKING:
    import numpy as np

    from pipezero.pipe.schedule.simulate import SimResult

__all__ = ["to_text", "to_chrome_trace", "to_image", "to_png", "text_size", "COLORS"]

COLORS: dict[Op, tuple[int, int, int]] = {
    Op.FORWARD: (66, 133, 244),          # blue
    Op.BACKWARD: (142, 68, 173),         # purple
    Op.BACKWARD_INPUT: (52, 168, 83),    # green
    Op.BACKWARD_WEIGHT: (251, 140, 0),   # orange
}
_OP_NAMES = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "backward input",
             Op.BACKWARD_WEIGHT: "backward weight"}
_INK = (0, 0, 0)


def to_text(schedule: Any, mark: Iterable[tuple[int, int]] = ()) -> str:
    """The step x rank grid of a schedule (dict rank -> actions) or of a SimResult.

    For a dict, step k is the k-th action of each rank's list. For a SimResult, each row is
    one time slot (every whole time unit when the times are whole, else every start and end):
    an action shows at its start and as "." while it runs, an idle rank as a blank cell, so
    gaps read as in the picture. `mark` holds (rank, step)
    cells to bracket, e.g. "[0F3]" (steps index the lists, for dicts only).
    """
    if isinstance(schedule, Mapping):
        p = len(schedule)
        rows = max((len(schedule[r]) for r in range(p)), default=0)
        cells = [[str(schedule[r][k]) if k < len(schedule[r]) else "" for r in range(p)]
                 for k in range(rows)]
        labels, axis = [str(k) for k in range(rows)], "step"
    elif hasattr(schedule, "timeline"):
        cells, labels, p = _timed_cells(schedule)
        axis = "time"
    else:
        raise TypeError(f"to_text needs a dict rank -> actions (e.g. sched.actions(num_stages)) "
                        f"or a SimResult, got {type(schedule).__name__}")
    marked = set(mark)
    for r, k in marked:
        if 0 <= k < len(cells) and 0 <= r < p:
            cells[k][r] = f"[{cells[k][r] or ' '}]"
    width = max([len(f"rank {p - 1}")] + [len(c) for row in cells for c in row]) + 2
    label_w = max([len(axis)] + [len(x) for x in labels])
    head = axis.rjust(label_w) + "  " + "".join(f"rank {r}".ljust(width) for r in range(p))
    body = [lab.rjust(label_w) + "  " + "".join(c.ljust(width) for c in row)
            for lab, row in zip(labels, cells)]
    return "\n".join(line.rstrip() for line in [head, *body])


def _timed_cells(result: "SimResult") -> tuple[list[list[str]], list[str], int]:
    """One row per time slot; an action of zero cost gets the row of its start, beside any other
    action starting there on its rank ("0B0 0F1"), so every action of the timeline shows."""
    p = result.num_stages
    starts = {e.start for e in result.timeline}
    times = {t for e in result.timeline for t in (e.start, e.end)}
    if all(float(t).is_integer() for t in times) and result.makespan <= 10_000:
        times |= set(range(int(result.makespan)))
    times = sorted(t for t in times if t < result.makespan or t in starts)
    row_of = {t: k for k, t in enumerate(times)}
    cells = [[""] * p for _ in times]
    for e in sorted(result.timeline, key=lambda e: (e.start, e.rank, e.step)):
        first = row_of[e.start]
        held = cells[first][e.rank]
        cells[first][e.rank] = f"{held} {e.action}" if held and held != "." else str(e.action)
        for k in range(first + 1, len(times)):
            if times[k] >= e.end:
                break
            cells[k][e.rank] = "."
    return cells, [f"{t:g}" for t in times], p


def to_chrome_trace(result: "SimResult", time_unit_us: float = 1000.0) -> dict[str, Any]:
    """A chrome://tracing (or Perfetto) JSON dict: one row (thread) per rank.

    One simulated time unit is drawn as `time_unit_us` microseconds (default 1 ms).
    Save with `json.dump(trace, f)`.
    """
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in range(result.num_stages)]
    for e in result.timeline:
        events.append({
            "name": str(e.action), "cat": e.action.op.name.lower(), "ph": "X", "pid": 0,
            "tid": e.rank, "ts": e.start * time_unit_us, "dur": (e.end - e.start) * time_unit_us,
            "args": {"chunk": e.action.chunk, "microbatch": e.action.microbatch,
                     "op": e.action.op.name, "step": e.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"makespan": result.makespan, "bubble": result.bubble}}


def _color(a: Action, num_chunks: int) -> np.ndarray:
    """The op's colour, lighter for later chunks (chunk c of v mixed 0.5*c/v with white)."""
    import numpy as np

    base = np.array(COLORS[a.op], dtype=np.float64)
    mix = 0.5 * a.chunk / max(num_chunks, 1)
    return base + (255.0 - base) * mix


def to_image(result: "SimResult", px_per_unit: float | None = None,
             row_height: int = 24, gap: int = 4, labels: bool = True) -> np.ndarray:
    """The timeline as an H x W x 3 uint8 array: rank 0 on top, time to the right.

    `px_per_unit` defaults to a width of about 1200 pixels (at least 2 per time unit).
    With `labels` the plot gets rank labels on the left, a time axis and a legend below.
    """
    span = max(result.makespan, 1e-9)
    scale = px_per_unit if px_per_unit is not None else max(2.0, 1200.0 / span)
    plot = _plot(result, scale, row_height, gap)
    return _framed(plot, result, scale, row_height, gap) if labels else plot


def _plot(result: "SimResult", scale: float, row_height: int, gap: int) -> np.ndarray:
    """The boxes alone: one row per rank, white where a rank idles."""
    import numpy as np  # only the picture needs numpy

    span = max(result.makespan, 1e-9)
    width = int(np.ceil(span * scale)) + 2 * gap
    height = result.num_stages * (row_height + gap) + gap
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    for e in result.timeline:
        x0 = gap + int(round(e.start * scale))
        x1 = max(gap + int(round(e.end * scale)), x0 + 1)
        y0 = gap + e.rank * (row_height + gap)
        fill = _color(e.action, result.num_chunks)
        img[y0:y0 + row_height, x0:x1] = (fill * 0.6).astype(np.uint8)  # border
        if x1 - x0 > 2 and row_height > 2:
            img[y0 + 1:y0 + row_height - 1, x0 + 1:x1 - 1] = fill.astype(np.uint8)
    return img


def _framed(plot: np.ndarray, result: "SimResult", scale: float, row_height: int, gap: int) -> np.ndarray:
    """The plot with rank labels (left), a time axis with ticks (below) and a legend of the ops."""
    import numpy as np

    ph, pw = plot.shape[:2]
    left = text_size(f"rank {result.num_stages - 1}")[0] + 8
    ops = [op for op in COLORS if any(e.action.op is op for e in result.timeline)]
    legend = [f"{op.value} {_OP_NAMES[op]}" for op in ops]
    if result.num_chunks > 1:
        legend.append("lighter: later chunks")
    legend_w = sum(text_size(t)[0] + 28 for t in legend)
    img = np.full((ph + 60, max(left + pw, legend_w + 8) + 8, 3), 255, dtype=np.uint8)
    img[:ph, left:left + pw] = plot
    texts = [(4, gap + r * (row_height + gap) + (row_height - 10) // 2, f"rank {r}") for r in range(result.num_stages)]
    x0, end = left + gap, left + gap + int(round(result.makespan * scale))
    img[ph, x0:end + 1] = _INK
    for t in _ticks(result.makespan):
        x = x0 + int(round(t * scale))
        img[ph:ph + 4, x] = _INK
        label = f"{t:g}"
        texts.append((x - text_size(label)[0] // 2, ph + 6, label))
    texts.append(((x0 + end - text_size("time")[0]) // 2, ph + 20, "time"))
    x = left
    for text, op in zip(legend, ops + [None]):
        if op is not None:
            img[ph + 40:ph + 50, x:x + 10] = COLORS[op]
        texts.append((x + 14, ph + 40, text))
        x += text_size(text)[0] + 28
    return _with_texts(img, texts)


def text_size(text: str) -> tuple[int, int]:
    """(width, height) in pixels of `text` in the pictures' font."""
    box = _font().getbbox(text)
    return box[2], box[3]


def _font():
    from PIL import ImageFont

    return ImageFont.load_default_imagefont()  # the bitmap font: no anti-aliasing, the same pixels everywhere


def _with_texts(img: np.ndarray, texts: list[tuple[int, int, str]]) -> np.ndarray:
    """`img` with each text drawn in ink, its top-left corner at (x, y); clipped at the edges."""
    import numpy as np
    from PIL import Image, ImageDraw

    canvas = Image.fromarray(img)
    draw, font = ImageDraw.Draw(canvas), _font()
    for x, y, text in texts:
        draw.text((x, y), text, fill=_INK, font=font)
    return np.array(canvas)


def _ticks(makespan: float) -> list[float]:
    """Round tick positions (steps of 1, 2 or 5 times a power of ten), about ten of them."""
    import math

    if makespan <= 0:
        return [0.0]
    raw = makespan / 10
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(makespan // step) + 1)]


def to_png(result: "SimResult", path: str | Path, **image_kwargs: Any) -> Path:
    """Write `to_image(result)` as a PNG file and return its path."""
    from PIL import Image

    path = Path(path)
    Image.fromarray(to_image(result, **image_kwargs)).save(path, format="PNG")
    return path
