"""Value checks shared by the PS's specs and Python faces (no torch: the server program
checks its flags through the specs before it imports torch).

Each check names the argument the caller passed and raises TypeError (type) or ValueError
(value) before any native work starts. `spec_arg` is how every component takes its spec: the
spec itself, its fields as keywords, or both (the keywords replace the spec's fields).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, TypeVar

from torchrec_bagpipe.config import parse_memory_budget

__all__ = [
    "budget_arg",
    "float_arg",
    "int_arg",
    "lr_arg",
    "optional_path",
    "path_arg",
    "spec_arg",
    "step_lr_arg",
]

S = TypeVar("S")


def int_arg(value: Any, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def float_arg(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def lr_arg(value: Any, name: str = "lr") -> float:
    """A configured learning rate: a finite float > 0 (0 or less would not train, or would
    train backwards)."""
    value = float_arg(value, name)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def step_lr_arg(value: Any, name: str = "lr") -> float:
    """One step's learning rate under a schedule: a finite float >= 0 (a warm-up may start
    at 0; a negative rate would train backwards)."""
    value = float_arg(value, name)
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def budget_arg(value: Any) -> int:
    """None -> 0 (unlimited), 'auto' -> -1, else bytes (int or '512M' / '4G' strings)."""
    return 0 if value is None else parse_memory_budget(value, "memory_budget")


def path_arg(path: Any, name: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{name} must be a non-empty path")
    return text


def optional_path(value: Any, name: str) -> str:
    """A path, or "" for None."""
    if value is None:
        return ""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path, got {type(value).__name__}")
    return os.fspath(value)


def spec_arg(cls: type[S], spec: Any, fields: dict[str, Any], what: str) -> S:
    """The spec a component was given: `spec` (a `cls`), `cls(**fields)` without one, or
    `spec` with `fields` replaced (`dataclasses.replace`: the checks run again)."""
    if spec is None:
        return cls(**fields)
    if not isinstance(spec, cls):
        raise TypeError(
            f"{what} takes a {cls.__name__} or its fields as keywords, got "
            f"{type(spec).__name__}"
        )
    return dataclasses.replace(spec, **fields) if fields else spec  # type: ignore[type-var]
