"""Counters of one BagPipe controller; `snapshot()` returns a plain dict.

Accounting unit: one access = one unique key of one rank's batch at one step. Every access is
exactly one of: a hit (read from the cache, not fetched for this step), prefetch-served (its
row was fetched by a get issued before the step began) or demand-fetched (fetched at use).

Thread safety: `add` and `snapshot` may be called from any thread (the training thread and
the communication worker both count); `_lock` guards every field and is a leaf lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

__all__ = ["RuntimeMetrics"]


@dataclass
class RuntimeMetrics:
    steps: int = 0
    accesses: int = 0
    hits: int = 0
    prefetch_served: int = 0
    demand_fetched: int = 0
    prefetched: int = 0          # ids fetched by prefetch gets (issued ahead of use)
    prefetch_gets: int = 0
    demand_gets: int = 0
    staged_rows: int = 0         # prefetched rows moved to the prepared-batch queue
    evictions: int = 0
    invalidations: int = 0
    bypassed: int = 0            # misses that found no cache slot (served, not cached)
    stale: int = 0               # resident rows found at a wrong version (must stay 0)
    local_updates: int = 0       # resident rows updated by local SGD after a step
    dependency_waits: int = 0    # steps whose fetch waited for the previous commit
    skipped_dependency_waits: int = 0  # steps that did not, although it was pending
    fetch_wait_s: float = 0.0    # time the caller waited for rows from the PS
    commit_wait_s: float = 0.0   # time spent waiting for commits (predecessors, flush)
    collective_wait_s: float = 0.0
    gradient_payload_bytes: int = 0   # keys + fp32 gradients this rank sent to the PS
    allreduce_payload_bytes: int = 0  # fp32 gradients this rank all-reduced (collective)
    fetched_bytes: int = 0            # rows received from the PS
    written_back_rows: int = 0        # write-back aggregation: evicted rows assigned back
    write_back_bytes: int = 0         # ... their keys, weights and optimizer state
    flushed_rows: int = 0             # ... resident rows a drain assigned back
    flush_bytes: int = 0
    id_exchange_bytes: int = 0        # ids this rank sent in exchanges
    collectives_issued: int = 0
    window_steps: int = 0        # sum over prepared steps of the window's length then
    planner_s: float = 0.0
    runtime_critical_s: float = 0.0  # training thread inside submit / next_step / finish_step
    runtime_critical_cpu_s: float = 0.0  # ... its CPU time there (the rest is waiting)
    runtime_worker_s: float = 0.0    # this controller's tasks on its worker threads
    runtime_worker_cpu_s: float = 0.0  # ... the CPU time of those threads in them
    prescan_startup_s: float = 0.0
    shutdown_s: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            d = {f.name: getattr(self, f.name) for f in fields(self)}
        acc = d["accesses"]
        d["hit_rate"] = d["hits"] / acc if acc else 0.0
        d["cache_served_rate"] = (d["hits"] + d["prefetch_served"]) / acc if acc else 0.0
        steps = d["steps"]
        d["window_mean"] = d["window_steps"] / steps if steps else 0.0
        d["runtime_critical_ms"] = 1e3 * d["runtime_critical_s"] / steps if steps else 0.0
        d["runtime_worker_ms"] = 1e3 * d["runtime_worker_s"] / steps if steps else 0.0
        d["runtime_worker_cpu_ms"] = 1e3 * d["runtime_worker_cpu_s"] / steps if steps else 0.0
        return d
