"""EvictionSpec: the eviction rule of a virtual table, as the runtime applies it.

A virtual table (TorchRec's ``use_virtual_table=True``) holds a row on the PS only from the
first step that trains it. Its eviction rule is decided at step boundaries from the keys each
step trains (every rank's, which every rank knows from the id exchange), by the native step
planner (``csrc/cache/eviction_rule.h``): so every rank, the PS and a single-process
reference agree on it without any extra message. The rule (docs/virtual_tables.md):

* ``count(k) += 1`` and ``last(k) = t`` for every key step t trains (once per step);
* a round runs at the boundary of t when ``trigger_rows == 0`` or live rows > ``trigger_rows``;
  in a round every live count is multiplied by ``decay_rate`` (float64), then a key not
  trained at t is evicted when ``threshold > 0 and count < threshold`` or ``ttl_steps > 0 and
  t - last >= ttl_steps``;
* an evicted row leaves the PS with its optimizer state; the next step that trains it
  recreates it from its initial value and zero state;
* admission (``admit_after > 1``): an id not live is trained only from the step at which it
  has been read in ``admit_after`` steps (since it last left); before, it is in no plan (no
  fetch, commit or dependency), its rows read as zeros (one zero row after the step's
  unique rows: ``Step.inverse`` points there) and its gradient is dropped;
* probabilistic admission (``admit_probability < 1``): at each of those steps from the
  ``admit_after``-th on, the id is admitted when its coin ``admit_coin(admit_seed, key, n)``
  (n: the steps it was read in since it last left) is below ``admit_probability``;
* the cap (``max_rows > 0``): a round also runs while live rows exceed it, and after the
  threshold / TTL evictions the rows not trained at t are evicted oldest ``last`` first
  (then lowest count, then lowest key) until live rows <= max_rows: the memory bound holds at
  every boundary unless step t alone trains more rows than the cap.

Rank 0 sends each step's evicted keys with its commit of the step (``PSClient.commit_async(...,
evict=)``); the shards erase them before serving any read of the step. The planner treats an
eviction as a write at step t (a later read depends on commit t; every cached copy is dropped),
so no cache or prefetch buffer ever serves an evicted row.

Thread safety: immutable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["VIRTUAL_AUTO_CACHE_ROWS", "EvictionSpec"]

# The automatic cache size of a virtual table is taken from at most this many rows (its
# `num_embeddings` is an id space, not a row count).
VIRTUAL_AUTO_CACHE_ROWS = 1 << 20


@dataclass(frozen=True)
class EvictionSpec:
    """The eviction rule of a virtual table (all zero: rows are never evicted)."""

    threshold: float = 0.0    # count rule: evict below this decayed count (0: off)
    decay_rate: float = 1.0   # count rule: factor applied to every count each round, (0, 1]
    ttl_steps: int = 0        # step TTL: evict rows not trained for this many steps (0: off)
    trigger_rows: int = 0     # rounds run only while live rows exceed this (0: every step)
    admit_after: int = 0      # admission: an id is trained only once read in this many steps
                              # (<= 1: at once); until then it reads zeros, its gradient dropped
    admit_probability: float = 1.0  # admission: then admitted with this probability at each
                                    # read step, by a seeded coin (1: always); in (0, 1]
    admit_seed: int = 0       # admission: the coins' seed, in [0, 2^64)
    max_rows: int = 0         # hard cap on live rows after each round (0: none): beyond the
                              # threshold / TTL, the rows trained longest ago are evicted

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
                and self.threshold >= 0):
            raise ValueError(f"EvictionSpec.threshold must be finite and >= 0, got "
                             f"{self.threshold!r}")
        if not (isinstance(self.decay_rate, (int, float)) and 0 < self.decay_rate <= 1):
            raise ValueError(f"EvictionSpec.decay_rate must lie in (0, 1], got "
                             f"{self.decay_rate!r}")
        p = self.admit_probability
        if isinstance(p, bool) or not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise ValueError(f"EvictionSpec.admit_probability must lie in (0, 1], got {p!r}")
        s = self.admit_seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 1 << 64:
            raise ValueError(f"EvictionSpec.admit_seed must be an int in [0, 2^64), got {s!r}")
        for name in ("ttl_steps", "trigger_rows", "admit_after", "max_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"EvictionSpec.{name} must be an int >= 0, got {v!r}")

    @property
    def enabled(self) -> bool:
        """Whether rows are ever evicted."""
        return self.threshold > 0 or self.ttl_steps > 0 or self.max_rows > 0

    @property
    def tracks(self) -> bool:
        """Whether the planner keeps the rule (eviction or admission)."""
        return self.enabled or self.admits

    @property
    def admits(self) -> bool:
        """Whether admission filters new ids."""
        return self.admit_after > 1 or self.admit_probability < 1

    def native(self) -> dict[str, Any]:
        """The options of the native rule (``C.EvictionRule``, ``C.StepPlanner(eviction=)``)."""
        return {"threshold": float(self.threshold), "decay_rate": float(self.decay_rate),
                "ttl_steps": int(self.ttl_steps), "trigger_rows": int(self.trigger_rows),
                "admit_after": int(self.admit_after),
                "admit_probability": float(self.admit_probability),
                "admit_seed": int(self.admit_seed), "max_rows": int(self.max_rows)}
