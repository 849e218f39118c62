from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from splitserve.common.arith import ceil_div


@given(st.integers(min_value=0, max_value=2**40), st.integers(min_value=1, max_value=2**20))
def test_ceil_div_rounds_up(a, b):
    assert ceil_div(a, b) == math.ceil(a / b)


def test_ceil_div_stays_exact_past_float_precision():
    a = 2**60 + 1
    assert ceil_div(a, 2) == 2**59 + 1


def test_ceil_div_works_on_integer_arrays():
    assert ceil_div(np.array([0, 1, 16, 17]), 16).tolist() == [0, 1, 1, 2]
