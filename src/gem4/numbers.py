"""The one check of "a real, finite number" shared by the checkpoint and request validators."""
from __future__ import annotations

import math


def is_finite_number(x) -> bool:
    """An int or float (not a bool) that is finite; False for ints beyond float's range."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
