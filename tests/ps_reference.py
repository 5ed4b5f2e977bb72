"""A reference parameter server: a dict of numpy rows updated with the synchronous-SGD
arithmetic of docs/ARCHITECTURE.md §1, sharing no code with the native PS."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from store_reference import reference_initial_rows, sgd_reference


class ReferencePS:
    def __init__(self, dim: int, lr: float, world_size: int, *, division: bool = True,
                 init: str = "zeros", init_bound: float | None = None, init_value: float = 0.0,
                 seed: int = 0) -> None:
        self.dim = dim
        self.lr = float(np.float32(lr))
        self.world_size = world_size
        self.divisor = world_size if division else 1
        self.init = (init, init_bound, init_value, seed)
        self.rows: dict[int, np.ndarray] = {}
        self.committed = -1

    def initial(self, keys: Sequence[int]) -> np.ndarray:
        init, bound, value, seed = self.init
        return reference_initial_rows(np.asarray(keys, dtype=np.int64), self.dim, init, bound,
                                      value, seed)

    def row(self, key: int) -> np.ndarray:
        r = self.rows.get(int(key))
        return r if r is not None else self.initial([key])[0]

    def lookup(self, keys: Sequence[int]) -> np.ndarray:
        if len(keys) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self.row(int(k)) for k in keys]).astype(np.float32)

    def assign(self, keys: Sequence[int], rows: np.ndarray) -> None:
        for k, r in zip(keys, rows):
            self.rows[int(k)] = np.asarray(r, dtype=np.float32).copy()

    def apply_step(self, per_rank: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """One step: rank 0's rows, then rank 1's, ... (each in its input order)."""
        grads_of: dict[int, list[np.ndarray]] = {}
        for keys, grads in per_rank:
            for k, g in zip(np.asarray(keys).tolist(), np.asarray(grads, dtype=np.float32)):
                grads_of.setdefault(int(k), []).append(g)
        for k, gs in grads_of.items():
            self.rows[k] = sgd_reference(self.row(k), gs, self.lr, self.divisor)
        self.committed += 1
