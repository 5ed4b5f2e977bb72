"""ID trace generators shared by the benchmarks (cache_policy.py, scale_sim.py).

A trace is `trace[t][r]`: rank r's fused keys (int64 numpy) at step t. Kinds:
  * ``zipf<a>`` (e.g. ``zipf1.05``): bounded power-law ranks, the hot ranks scattered over the
    key space (id = rank * SCATTER mod rows), the same law every step;
  * ``drifting`` (alias ``time_ordered`` in cache_policy.py's tables): Zipf 1.05 whose hot set
    moves through half the key space in `horizon` steps (the ranks shift by
    t * rows / (2 * horizon)); horizon defaults to the run's steps;
  * ``arrival``: ids in arrival order, as a day-ordered log (Criteo 1TB) sees them: at step t
    ids [0, frontier(t)) exist, frontier growing linearly from rows / 4 to rows over `horizon`
    steps, and the newest are the most popular (id = frontier - 1 - Zipf 1.05 rank, not
    scattered).
With ``features`` > 1 a rank's batch is `batch` samples x `features` ids, feature f's ids in
[f * rows_per_feature, (f + 1) * rows_per_feature) (one fused table of `features` tables, a
pooling factor of 1), laid out feature-major: keys[f * batch:(f + 1) * batch].
"""

from __future__ import annotations

import numpy as np

__all__ = ["SCATTER", "make_trace", "zipf_ranks"]

SCATTER = 2654435761  # a prime: id = rank * SCATTER mod N scatters the hot ranks


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, a: float) -> np.ndarray:
    """Bounded power-law ranks in [0, rows) (continuous inverse CDF)."""
    u = rng.random(n)
    if abs(a - 1.0) < 1e-9:
        r = np.floor((rows + 1.0) ** u) - 1
    else:
        e = 1.0 - a
        r = np.floor((((rows + 1.0) ** e - 1.0) * u + 1.0) ** (1.0 / e)) - 1
    return np.clip(r, 0, rows - 1).astype(np.int64)


def _feature_ids(kind: str, rng: np.random.Generator, n: int, rows: int, t: int,
                 horizon: int) -> np.ndarray:
    """n ids in [0, rows) of one feature at step t."""
    if kind.startswith("zipf"):
        return (zipf_ranks(rng, n, rows, float(kind[4:])) * SCATTER) % rows
    if kind in ("drifting", "time_ordered"):
        shift = (t * rows) // (2 * horizon)
        return ((zipf_ranks(rng, n, rows, 1.05) + shift) % rows * SCATTER) % rows
    if kind == "arrival":
        frontier = min(rows, max(1, rows // 4 + (t * (rows - rows // 4)) // max(1, horizon - 1)))
        return frontier - 1 - zipf_ranks(rng, n, frontier, 1.05)
    raise ValueError(f"unknown trace kind {kind!r} (zipf<a>, drifting, time_ordered, arrival)")


def make_trace(kind: str, rows: int, steps: int, batch: int, seed: int, world: int = 1,
               features: int = 1, horizon: int | None = None) -> list[list[np.ndarray]]:
    """`steps` steps of `world` ranks, each `batch` samples x `features` ids (module doc)."""
    horizon = steps if horizon is None else horizon
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    if rows < features:
        raise ValueError(f"rows ({rows}) must be >= features ({features})")
    rng = np.random.default_rng(seed)
    per = rows // features
    out = []
    for t in range(steps):
        ranks = []
        for _ in range(world):
            parts = [f * per + _feature_ids(kind, rng, batch, per, t, horizon)
                     for f in range(features)]
            ranks.append(np.concatenate(parts).astype(np.int64))
        out.append(ranks)
    return out
