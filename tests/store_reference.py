"""Independent numpy re-implementations used to check the native store bit for bit.

`reference_initial_rows` follows the formula stated in csrc/store/init.h without sharing any
code with it; `sgd_reference` is the update of docs/ARCHITECTURE.md §1 in separate fp32 ops;
`optimizer_reference` is the arithmetic contract of csrc/store/embedding_store.h (steps
1-10), one numpy float32 operation (one rounding) per step.
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


def _pairwise_row_sum(x: np.ndarray) -> np.float32:
    """Contract step 7: zero-pad to a power of two, add halves until one value is left."""
    width = 1
    while width < x.shape[0]:
        width *= 2
    t = np.zeros(width, dtype=np.float32)
    t[: x.shape[0]] = x
    while width > 1:
        width //= 2
        t = (t[:width] + t[width:]).astype(np.float32)
    return np.float32(t[0])


def optimizer_reference(
    w: np.ndarray,
    state: np.ndarray,
    grads: list[np.ndarray],
    lr: float,
    divisor: int,
    kind: str,
    eps: float = 1e-8,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """One update of one row (w: dim floats, state: state_dim floats) by its gradient rows
    in input order; returns the new (w, state). Every step is one float32 numpy op."""
    f = np.float32
    with np.errstate(all="ignore"):
        g = np.array(grads[0], dtype=f, copy=True)  # step 1: the first copied
        for extra in grads[1:]:
            g = (g + extra.astype(f)).astype(f)
        u = g
        if divisor != 1:  # step 2
            u = (u / f(divisor)).astype(f)
        if weight_decay != 0.0:  # step 3
            u = (u + (w * f(weight_decay)).astype(f)).astype(f)
        lr32, eps32 = f(lr), f(eps)
        if kind == "sgd":  # step 4
            return (w - (u * lr32).astype(f)).astype(f), state.copy()
        if kind == "adagrad":  # step 5
            s = (state + (u * u).astype(f)).astype(f)
            d = (np.sqrt(s) + eps32).astype(f)
            return (w - ((u / d).astype(f) * lr32).astype(f)).astype(f), s
        if kind == "rowwise_adagrad":  # steps 6-7
            r = f(_pairwise_row_sum((u * u).astype(f)) / f(w.shape[0]))
            s = f(state[0] + r)
            d = f(np.sqrt(s) + eps32)
            m = f(lr32 / d)
            return (w - (u * m).astype(f)).astype(f), np.array([s], dtype=f)
        assert kind == "adam"  # step 8
        dim = w.shape[0]
        c1, c2 = f(1.0 - beta1), f(1.0 - beta2)
        m0, v0 = state[:dim], state[dim:]
        m1 = (m0 + ((u - m0).astype(f) * c1).astype(f)).astype(f)
        v1 = (v0 + (((u * u).astype(f) - v0).astype(f) * c2).astype(f)).astype(f)
        d = (np.sqrt(v1) + eps32).astype(f)
        w1 = (w - ((m1 / d).astype(f) * lr32).astype(f)).astype(f)
        return w1, np.concatenate([m1, v1]).astype(f)


def same_bits_or_both_nan(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality, except that any NaN equals any NaN (payloads are not specified)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    if a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return False
    return bool(np.array_equal(a.view(np.uint32)[~nan_a], b.view(np.uint32)[~nan_b]))


_P1 = 11400714785074694791
_P2 = 14029467366897019727
_P3 = 1609587929392839161
_P4 = 9650029242287828579
_P5 = 2870177450012600261
_MASK = (1 << 64) - 1


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _round(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _MASK
    return (_rotl(acc, 31) * _P1) & _MASK


def xxh64(data: bytes, seed: int = 0) -> int:
    """Plain-Python XXH64 (the checkpoint checksum), for crafting manifests in tests."""
    n = len(data)
    p = 0
    if n >= 32:
        v = [
            (seed + _P1 + _P2) & _MASK,
            (seed + _P2) & _MASK,
            seed,
            (seed - _P1) & _MASK,
        ]
        while p + 32 <= n:
            for i in range(4):
                v[i] = _round(v[i], int.from_bytes(data[p + 8 * i : p + 8 * i + 8], "little"))
            p += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _MASK
        for lane in v:
            h ^= _round(0, lane)
            h = (h * _P1 + _P4) & _MASK
    else:
        h = (seed + _P5) & _MASK
    h = (h + n) & _MASK
    while p + 8 <= n:
        h ^= _round(0, int.from_bytes(data[p : p + 8], "little"))
        h = (_rotl(h, 27) * _P1 + _P4) & _MASK
        p += 8
    if p + 4 <= n:
        h ^= (int.from_bytes(data[p : p + 4], "little") * _P1) & _MASK
        h = (_rotl(h, 23) * _P2 + _P3) & _MASK
        p += 4
    while p < n:
        h ^= (data[p] * _P5) & _MASK
        h = (_rotl(h, 11) * _P1) & _MASK
        p += 1
    h ^= h >> 33
    h = (h * _P2) & _MASK
    h ^= h >> 29
    h = (h * _P3) & _MASK
    h ^= h >> 32
    return h


def rewrite_manifest(path: str, edit) -> None:
    """Applies edit(json_text) -> json_text to a checkpoint's MANIFEST, re-signing it."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    body = text[: text.rindex("#xxh64 ")]
    body = edit(body)
    with open(path, "w", encoding="utf-8") as f:
        f.write(body + f"#xxh64 {xxh64(body.encode()):016x}\n")
