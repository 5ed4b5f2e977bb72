"""Independent numpy re-implementations used to check the native store bit for bit.

`reference_initial_rows` follows the formula stated in csrc/store/init.h without sharing any
code with it; `sgd_reference` is the update of docs/ARCHITECTURE.md §1 in separate fp32 ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def reference_initial_rows(
    keys: np.ndarray,
    dim: int,
    init: str = "uniform",
    init_bound: float | Sequence[tuple[int, float]] | None = None,
    init_value: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.shape[0]
    if init == "zeros":
        return np.zeros((n, dim), dtype=np.float32)
    if init == "constant":
        return np.full((n, dim), np.float32(init_value), dtype=np.float32)
    assert init == "uniform"
    if isinstance(init_bound, (int, float)):
        bound = np.full(n, np.float32(init_bound), dtype=np.float32)
    else:
        starts = np.array([s for s, _ in init_bound], dtype=np.int64)
        values = np.array([b for _, b in init_bound], dtype=np.float32)
        idx = np.searchsorted(starts, keys, side="right") - 1
        bound = values[np.maximum(idx, 0)]
    with np.errstate(over="ignore"):
        base = splitmix64(np.uint64(seed) ^ splitmix64(keys.astype(np.uint64)))
        cols = np.arange(dim, dtype=np.uint64) * _GAMMA
        bits = splitmix64(base[:, None] + cols[None, :])
    k = (bits >> np.uint64(40)).astype(np.int64) * 2 - (1 << 24)
    s = k.astype(np.float32) * np.float32(2.0**-24)
    return (s * bound[:, None]).astype(np.float32)


def sgd_reference(w: np.ndarray, grads: list[np.ndarray], lr: float, divisor: int) -> np.ndarray:
    """w - lr * (sum of grads in order) / divisor, each step an fp32 op."""
    g = grads[0].astype(np.float32).copy()
    for extra in grads[1:]:
        g = (g + extra).astype(np.float32)
    if divisor != 1:
        g = (g / np.float32(divisor)).astype(np.float32)
    u = (g * np.float32(lr)).astype(np.float32)
    return (w - u).astype(np.float32)
