"""A reference parameter server: a dict of numpy rows (and their optimizer state) updated
with the arithmetic of docs/ARCHITECTURE.md §1 and csrc/store/embedding_store.h, sharing no
code with the native PS."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from store_reference import optimizer_reference, reference_initial_rows

STATE_DIM = {"sgd": lambda d: 0, "adagrad": lambda d: d, "rowwise_adagrad": lambda d: 1,
             "adam": lambda d: 2 * d}


class ReferencePS:
    """`optimizer`: (kind, {eps, beta1, beta2, weight_decay, initial_accumulator_value})."""

    def __init__(self, dim: int, lr: float, world_size: int, *, division: bool = True,
                 init: str = "zeros", init_bound: float | None = None, init_value: float = 0.0,
                 seed: int = 0, optimizer: str = "sgd", **constants: float) -> None:
        self.dim = dim
        self.lr = float(np.float32(lr))
        self.world_size = world_size
        self.divisor = world_size if division else 1
        self.init = (init, init_bound, init_value, seed)
        self.kind = optimizer
        self.constants = {"eps": 1e-8, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0,
                          **constants}
        self.initial_accumulator_value = self.constants.pop("initial_accumulator_value", 0.0)
        self.state_dim = STATE_DIM[optimizer](dim)
        self.rows: dict[int, np.ndarray] = {}
        self.state: dict[int, np.ndarray] = {}
        self.committed = -1

    def initial(self, keys: Sequence[int]) -> np.ndarray:
        init, bound, value, seed = self.init
        return reference_initial_rows(np.asarray(keys, dtype=np.int64), self.dim, init, bound,
                                      value, seed)

    def row(self, key: int) -> np.ndarray:
        r = self.rows.get(int(key))
        return r if r is not None else self.initial([key])[0]

    def row_state(self, key: int) -> np.ndarray:
        s = self.state.get(int(key))
        if s is not None:
            return s
        fill = self.initial_accumulator_value if self.kind in ("adagrad", "rowwise_adagrad") else 0
        return np.full(self.state_dim, np.float32(fill), dtype=np.float32)

    def lookup(self, keys: Sequence[int], *, with_state: bool = False) -> np.ndarray:
        width = self.dim + (self.state_dim if with_state else 0)
        if len(keys) == 0:
            return np.zeros((0, width), dtype=np.float32)
        rows = [self.row(int(k)) for k in keys]
        if with_state:
            rows = [np.concatenate([r, self.row_state(int(k))]) for r, k in zip(rows, keys)]
        return np.stack(rows).astype(np.float32)

    def assign(self, keys: Sequence[int], rows: np.ndarray) -> None:
        for k, r in zip(keys, rows):
            self.rows[int(k)] = np.asarray(r, dtype=np.float32).copy()

    def apply_step(self, per_rank: Sequence[tuple[np.ndarray, np.ndarray]],
                   lr: float | None = None) -> None:
        """One step with learning rate `lr` (default: the constructor's): rank 0's rows, then
        rank 1's, ... (each in its input order)."""
        lr = self.lr if lr is None else float(np.float32(lr))
        grads_of: dict[int, list[np.ndarray]] = {}
        for keys, grads in per_rank:
            for k, g in zip(np.asarray(keys).tolist(), np.asarray(grads, dtype=np.float32)):
                grads_of.setdefault(int(k), []).append(g)
        for k, gs in grads_of.items():
            w, s = optimizer_reference(self.row(k), self.row_state(k), gs, lr, self.divisor,
                                       self.kind, **self.constants)
            self.rows[k] = w
            self.state[k] = s
        self.committed += 1
