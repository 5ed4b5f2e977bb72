"""The synthetic job shared by the multi-process PS tests and their worker processes: every
(step, rank) has a deterministic batch, so a replayed step sends identical packets."""

from __future__ import annotations

import numpy as np

DIM = 8
KEYS = 400
LR = 0.05
TABLE = "emb"
INIT = {"init": "uniform", "init_bound": 0.1, "seed": 3}
CLIENT = {"partitioner": "hash", "max_packet_rows": 16, "inflight_packets": 4}


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step * 7919 + rank * 104729 + 1)
    n = int(rng.integers(0, 40)) if step % 13 else 0  # every 13th step is empty everywhere
    keys = rng.integers(0, KEYS, n).astype(np.int64)
    grads = (rng.integers(-256, 256, (n, DIM)) / 64.0).astype(np.float32)
    return keys, grads
