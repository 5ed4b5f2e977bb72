"""Tensor argument checks shared by the PS's Python faces (store, shard, client).

Each check names the argument the caller passed and raises TypeError (dtype, layout, device)
or ValueError (shape) before any native work starts. They run on every batch op: each costs
tens of nanoseconds (no device objects).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["keys_arg", "numpy_view", "out_arg", "rows_arg", "tensor_arg"]


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
