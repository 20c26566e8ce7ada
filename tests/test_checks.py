"""checks.py: the int / number predicates every config uses refuse bools, NaN and (by default) inf."""

import math

from pipezero.checks import is_int, is_number


def test_is_int_refuses_bools_floats_and_small_values():
    assert is_int(3) and is_int(0) and is_int(-2, minimum=-2)
    assert not is_int(True) and not is_int(False) and not is_int(3.0) and not is_int("3")
    assert not is_int(1, minimum=2) and is_int(2, minimum=2)


def test_is_number_refuses_bools_nan_and_inf_unless_asked():
    assert is_number(0.5) and is_number(2) and is_number(0, minimum=0) and not is_number(0, above=0)
    assert not is_number(True) and not is_number(None) and not is_number("1.0")
    assert not is_number(math.nan) and not is_number(math.nan, finite=False)
    assert not is_number(math.inf) and is_number(math.inf, above=0, finite=False)
    assert not is_number(-1e-9, minimum=0)
