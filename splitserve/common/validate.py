"""Field checks for config dataclasses: each ``__post_init__`` states its rules once, and every error
names the field (a caller that embeds the dataclass prefixes its own path, e.g. ``engine.``).

    check_range(self, "max_queue", min=1)          # max_queue: must be >= 1, got 0
    check_range(self, "op_timeout_s", above=0)     # op_timeout_s: must be > 0, got 0
    check_range(self, "metrics_port", min=0, max=65535)  # None passes: "not set" is always allowed
    check_choice(self, "decode_path", DECODE_PATHS)  # decode_path: must be one of auto, dynamic, ...
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import MISSING, fields
from typing import Any


def check_range(
    obj: Any,
    name: str,
    *,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    prefix: str = "",
    label: str | None = None,
) -> None:
    """Raise ValueError naming ``prefix + name`` unless ``obj.name`` is None or within the bounds:
    ``min <= value <= max`` and ``value > above`` (each bound optional). ``label`` is the name the error
    shows where the user knows the field by another (a command-line flag such as ``--max-concurrency``)."""
    value = getattr(obj, name)
    if value is None:
        return
    name = label or name
    if above is not None and not value > above:
        raise ValueError(f"{prefix}{name}: must be > {above}, got {value}")
    if min is not None and max is not None and not min <= value <= max:
        raise ValueError(f"{prefix}{name}: must be {min} to {max}, got {value}")
    if min is not None and not value >= min:
        raise ValueError(f"{prefix}{name}: must be >= {min}, got {value}")
    if max is not None and not value <= max:
        raise ValueError(f"{prefix}{name}: must be at most {max}, got {value}")


def check_ranges(obj: Any, names: Iterable[str], **bounds: float | None) -> None:
    """``check_range`` for several fields with the same bounds."""
    for name in names:
        check_range(obj, name, **bounds)


def check_choice(obj: Any, name: str, choices: Iterable[object], *, prefix: str = "", label: str | None = None) -> None:
    """Raise ValueError naming ``prefix + name`` (or ``label``) unless ``obj.name`` is one of ``choices``."""
    value, choices = getattr(obj, name), tuple(choices)
    if value not in choices:
        raise ValueError(f"{prefix}{label or name}: must be one of {', '.join(map(str, choices))}, got {value!r}")


def field_default(cls: type, name: str) -> Any:
    """The declared default of a dataclass field, for a caller (a deployment file, a CLI flag) that must not
    repeat it. Only plain defaults: a field without one (or with a default factory) is a programming error."""
    default = next(f.default for f in fields(cls) if f.name == name)
    assert default is not MISSING, f"{cls.__name__}.{name} has no default"
    return default
