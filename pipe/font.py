"""A 3x5 bitmap font, so schedule pictures carry labels with numpy alone (pillow is optional).

Each glyph is five rows of three pixels, a row written as one octal digit (4 = left pixel,
2 = middle, 1 = right): "25755" is an A. Lower case draws as upper case; a character
without a glyph draws as a blank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import numpy as np

__all__ = ["draw_text", "text_size"]

_GLYPHS = dict(zip(
    "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ -.:=/",
    ("75557 26227 71747 71317 55711 74717 74757 71111 75757 75717 "
     "25755 65656 34443 65556 74647 74644 34553 55755 72227 11152 55655 44447 57755 65555 25552 "
     "65644 25563 65655 34216 72222 55557 55552 55775 55255 55222 71247 00000 00700 00002 02020 07070 11244"
     ).split()))
_W, _H = 3, 5


def text_size(text: str, scale: int = 2) -> tuple[int, int]:
    """(width, height) in pixels of `text` drawn at `scale` (one blank column between glyphs)."""
    return max(0, len(text) * (_W + 1) - 1) * scale, _H * scale


def draw_text(img: "np.ndarray", x: int, y: int, text: str, color: Sequence[int] = (0, 0, 0),
              scale: int = 2) -> None:
    """Draw `text` into an H x W x 3 image with its top-left corner at (x, y); clipped at the edges."""
    h, w = img.shape[:2]
    for i, ch in enumerate(text.upper()):
        rows = _GLYPHS.get(ch, "00000")
        for r, digit in enumerate(rows):
            bits = int(digit, 8)
            for c in range(_W):
                if bits & (4 >> c):
                    x0, y0 = x + (i * (_W + 1) + c) * scale, y + r * scale
                    if 0 <= x0 and x0 + scale <= w and 0 <= y0 and y0 + scale <= h:
                        img[y0:y0 + scale, x0:x0 + scale] = color
