"""Argument checks shared by the PS's Python faces (store, shard, client, options).

Each check names the argument the caller passed and raises TypeError (type, dtype, layout,
device) or ValueError (value, shape) before any native work starts. The tensor checks run
on every batch op: each costs tens of nanoseconds (no device objects).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

import torch

from torchrec_bagpipe.config import parse_memory_budget

__all__ = [
    "budget_arg",
    "float_arg",
    "int_arg",
    "keys_arg",
    "numpy_view",
    "optional_path",
    "out_arg",
    "path_arg",
    "rows_arg",
    "tensor_arg",
]


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


def tensor_arg(t: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype {dtype}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if not t.is_cpu:
        raise TypeError(f"{name} must be a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise TypeError(f"{name} must be contiguous")
    return t


def numpy_view(t: torch.Tensor) -> Any:
    """Zero-copy numpy view of a checked tensor."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


def keys_arg(keys: Any, name: str = "keys") -> Any:
    keys = tensor_arg(keys, name, torch.int64)
    if keys.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(keys.shape)}")
    return numpy_view(keys)


def rows_arg(rows: Any, name: str, n: int, dim: int) -> Any:
    rows = tensor_arg(rows, name, torch.float32)
    if rows.dim() != 2 or rows.shape[0] != n or rows.shape[1] != dim:
        raise ValueError(f"{name} must have shape ({n}, {dim}), got {tuple(rows.shape)}")
    return numpy_view(rows)


def out_arg(out: Any, name: str, n: int, cols: int) -> torch.Tensor:
    """A writable (n, cols) float32 CPU output tensor; allocated when None."""
    if out is None:
        return torch.empty((n, cols), dtype=torch.float32)
    o = tensor_arg(out, name, torch.float32)
    if o.dim() != 2 or o.shape[0] != n or o.shape[1] != cols:
        raise ValueError(f"{name} must have shape ({n}, {cols}), got {tuple(o.shape)}")
    if o.requires_grad:
        raise ValueError(f"{name} must not require grad")
    return o


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
