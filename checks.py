"""The value checks every config and constructor repeats: an int that is not a bool, a finite number.

`isinstance(True, int)` holds in Python, so each check first refuses a bool; a float must be
finite unless the caller allows inf. The predicates only answer; the caller raises, naming its
own field and the fix (STYLE.md: errors state every value and the expected form). A root
module in the bottom import layer (it imports no pipezero), beside config_fields.py.
"""

from __future__ import annotations

import math

__all__ = ["is_int", "is_number"]


def is_int(value: object, minimum: int | None = None) -> bool:
    """An int (not a bool), at least `minimum` when given."""
    return not isinstance(value, bool) and isinstance(value, int) and (minimum is None or value >= minimum)


def is_number(value: object, minimum: float | None = None, above: float | None = None,
              finite: bool = True) -> bool:
    """An int or float (not a bool), finite unless finite=False, >= `minimum` and > `above` when given.

    NaN is never a number here: it fails every comparison, and isfinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if finite and not math.isfinite(value):
        return False
    return (minimum is None or value >= minimum) and (above is None or value > above) and value == value
