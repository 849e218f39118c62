"""splitserve/common/validate.py: the field checks every config dataclass runs in __post_init__."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from splitserve.common.validate import check_choice, check_range, check_ranges


@dataclass(frozen=True)
class Example:
    count: int | None = 1
    timeout_s: float = 1.0
    port: int | None = None
    kind: str = "a"

    def __post_init__(self) -> None:
        check_range(self, "count", min=1)
        check_range(self, "timeout_s", above=0)
        check_range(self, "port", min=0, max=65535)
        check_choice(self, "kind", ("a", "b"))


def test_valid_values_and_none_pass():
    assert Example(count=None, timeout_s=0.1, port=65535, kind="b").port == 65535


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"count": 0}, "count: must be >= 1, got 0"),
        ({"timeout_s": 0}, "timeout_s: must be > 0, got 0"),
        ({"timeout_s": float("nan")}, "timeout_s: must be > 0, got nan"),
        ({"port": 70000}, "port: must be 0 to 65535, got 70000"),
        ({"kind": "c"}, "kind: must be one of a, b, got 'c'"),
    ],
)
def test_errors_name_the_field_and_the_rule(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Example(**fields)


def test_several_fields_and_a_prefix():
    @dataclass(frozen=True)
    class Delays:
        a: float = 1.0
        b: float = 3.0

    check_ranges(Delays(), ("a", "b"), max=3)
    with pytest.raises(ValueError, match=r"^faults\.b: must be at most 2, got 3.0$"):
        check_ranges(Delays(), ("a", "b"), max=2, prefix="faults.")
