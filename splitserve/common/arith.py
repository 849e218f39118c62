"""Integer arithmetic the layers share."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, for ``b > 0``: how many ``b``-sized blocks hold ``a`` items.

    Floor division of the negation stays exact for any int (``math.ceil(a / b)`` goes through a float
    and is wrong past 2**53) and works elementwise on numpy integer arrays, which the model runner
    passes."""
    return -(-a // b)
