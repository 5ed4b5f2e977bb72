"""WritebackAggregation: the ranks' caches own their resident rows (``writeback``).

Upstream BagPipe's logically replicated cache (LRPP). The plans are replicated
(step_planner.h invariant 10): every rank's step reads the union of every rank's keys, so
every rank's cache metadata sees the same calls and makes the same decisions: a row is
resident in every cache or in none. Gradients are all-reduced over the union as in
``collective`` (`CollectiveAggregation`: S_now first, S_later on the worker) and applied to
the resident rows in every cache (weights and optimizer state, the PS's arithmetic); only
the rows no cache holds send their summed gradient to the PS (each by its designated rank).
A resident row's PS copy is stale until the row leaves the caches: the admission that
evicts it (at step t's preparation) records it (`WriteBackLog`), and at step t's assembly,
before its slot is refilled, its designated rank (key mod W) assigns its weights and state to
the PS (`PSPort.write_back`), ahead of that rank's commit of step t. A later fetch of the row
waits for that commit: its dependency is raised to t (`WriteBackLog.deps`), so it reads the
written-back row (each shard applies a client's messages in order).

`drain` (state dicts, DCP, checkpoints, `close`) first drains as ``collective`` does, then
writes back every resident row updated since the last full write-back (every draining rank
writes all of them: the values are the same on every rank) and the evicted rows of a step
prepared ahead whose assembly has not run yet, and waits: afterwards the PS holds the
synchronous value of every row.

Thread safety: as `CollectiveAggregation`. Every `WriteBackLog` call holds the controller's
cache lock: `evicted` and `deps` on whichever thread prepares a step, `send` (the assembly)
and `drain_rows` on the training thread.

Counters: `written_back_rows` / `write_back_bytes` (evicted rows), `flushed_rows` /
`flush_bytes` (a drain's).

Invariants:
  1. Resident rows are the same on every rank after every preparation (replicated plans,
     deterministic metadata).
  2. A row's PS copy is current whenever no cache holds it: its last update was a commit
     (non-resident at that step) or its write-back, and every fetch waits for both
     (dependency = max(plan dependency, write-back step)).
  3. A victim's row is read for its write-back at the assembly of the step that evicted it,
     before the slot is refilled and after every earlier step's update of it landed (a victim
     is unpinned: not an S_later row of the step before, whose rows stay pinned).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from torchrec_bagpipe.runtime.access_plans import StepPlan
from torchrec_bagpipe.runtime.collective_aggregation import CollectiveAggregation, CollectivePlan
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.runtime.ps_port import PSPort

__all__ = ["WriteBackLog", "WritebackAggregation"]

_EMPTY = np.zeros(0, dtype=np.int64)
_DENSE_KEYS = 1 << 24  # a table up to this many rows keeps its write-back steps in an array


class _Evicted(NamedTuple):
    """What one prepared step's admission did that its assembly has not finished yet."""

    keys: np.ndarray      # evicted keys, in eviction order
    slots: np.ndarray     # ... the slots they held (now given to admitted rows)
    admitted: np.ndarray  # every slot the step admitted into (filled at its assembly)
    written: bool         # a drain already wrote these rows back


class WriteBackLog:
    """Which rows went back to the PS after which step, and evictions not written yet."""

    def __init__(self, num_keys: int, *, rank: int, world_size: int,
                 committed: Callable[[], int]) -> None:
        self._rank = rank
        self._world_size = world_size
        self._committed = committed  # the PS's committed step (runtime numbering)
        self._dense = (np.full(num_keys, -1, dtype=np.int32) if num_keys <= _DENSE_KEYS
                       else None)
        # Larger tables: a map, pruned of the steps the PS committed (a get served after such
        # a step reads its write-backs whatever its own dependency), so it holds about the
        # evictions of the last few steps.
        self._sparse: dict[int, int] = {}
        self._prune_at = 1 << 16
        self._pending: dict[int, _Evicted] = {}  # step -> its admission's evictions

    def deps(self, keys: np.ndarray, deps: np.ndarray) -> np.ndarray:
        """Each key's dependency raised to the step of its last write-back."""
        if not keys.size:
            return deps
        if self._dense is not None:
            wb = self._dense[keys]
        elif self._sparse:
            get = self._sparse.get
            wb = np.fromiter((get(int(k), -1) for k in keys), dtype=np.int64, count=keys.size)
        else:
            return deps
        return np.maximum(deps, wb)

    def evicted(self, t: int, keys: np.ndarray, slots: np.ndarray,
                admitted: np.ndarray) -> None:
        """Step t's admission evicted `keys` from `slots` and filled `admitted` slots."""
        if keys.size:
            if self._dense is not None:
                self._dense[keys] = t
            else:
                self._sparse.update(zip(keys.tolist(), [t] * keys.size))
                if len(self._sparse) > self._prune_at:
                    done = self._committed()
                    self._sparse = {k: s for k, s in self._sparse.items() if s > done}
                    self._prune_at = max(1 << 16, 2 * len(self._sparse))
        if keys.size or admitted.size:
            self._pending[t] = _Evicted(keys, slots, admitted, False)

    def send(self, t: int, cache: DeviceCache, port: PSPort) -> None:
        """Step t's assembly, before its slots are refilled: this rank writes back its share
        (key mod W) of the rows step t evicted."""
        ev = self._pending.pop(t, None)
        if ev is None or ev.written or not ev.keys.size:
            return
        mine = np.flatnonzero(ev.keys % self._world_size == self._rank)
        if mine.size:
            port.write_back(ev.keys[mine], cache.gather(ev.slots[mine]).cpu())

    def drain_rows(self, meta: Any, cache: DeviceCache,
                   resident: bool) -> tuple[np.ndarray, torch.Tensor | None]:
        """The rows a drain writes back: the evicted rows of steps not assembled yet (all of
        them, marked written), and with `resident` every resident row except the slots those
        steps admitted into (not filled yet)."""
        keys, slots = [], []
        unfilled = []
        for t, ev in list(self._pending.items()):
            unfilled.append(ev.admitted)
            if not ev.written and ev.keys.size:
                keys.append(ev.keys)
                slots.append(ev.slots)
            self._pending[t] = ev._replace(written=True)
        if resident:
            rkeys, rslots = meta.resident_slots()
            if unfilled:
                keep = ~np.isin(rslots, np.concatenate(unfilled))
                rkeys, rslots = rkeys[keep], rslots[keep]
            keys.append(rkeys)
            slots.append(rslots)
        if not keys:
            return _EMPTY, None
        k, s = np.concatenate(keys), np.concatenate(slots)
        return k, (cache.gather(s).cpu() if k.size else None)

    def clear(self) -> None:
        """Forgets the evictions not assembled (their preparation is discarded)."""
        self._pending.clear()


class WritebackAggregation(CollectiveAggregation):
    def __init__(self, *, log: WriteBackLog, **kw: Any) -> None:
        super().__init__(**kw)
        self._log = log
        self._dirty = False  # a resident row was updated since the last full write-back

    def plan_finish(self, t: int, plan: StepPlan) -> CollectivePlan:
        """As collective, but this rank commits only the rows of its runs no cache holds."""
        p = super().plan_finish(t, plan)
        nu = plan.union_keys.size
        resident = np.zeros(p.size, dtype=bool)  # by buffer row
        resident[p.now_rows] = True
        resident[p.n_now + p.later_sel] = True
        runs = np.r_[np.arange(*p.now_run), np.arange(*p.later_run)]
        commit_rows = runs[~resident[runs]]
        # Buffer row -> union index (the layout is a permutation of the union).
        union_of_row = np.empty(nu, dtype=np.int64)
        union_of_row[p.grad_dest] = np.arange(nu)
        # The step's gradient is this rank's own rows (own_pos into the union).
        return p._replace(grad_dest=p.grad_dest[plan.own_pos],
                          keys=plan.union_keys[union_of_row[commit_rows]],
                          commit_rows=commit_rows)

    def finish(self, t: int, plan: StepPlan, grad: torch.Tensor, planned: CollectivePlan,
               lr: float) -> None:
        if planned.now_slots.size or planned.later_slots.size:
            self._dirty = True
        super().finish(t, plan, grad, planned, lr)

    def drain(self) -> None:
        super().drain()
        with self._cache_lock:
            if self._meta is None:
                return
            keys, rows = self._log.drain_rows(self._meta, self._cache, self._dirty)
        if rows is not None:
            self._port.write_back(keys, rows, flush=True)
        self._port.drain_commits()
        self._dirty = False

    def forget(self) -> None:
        """The cache is being cleared (after an external write): nothing is written back."""
        self._log.clear()
        self._dirty = False

