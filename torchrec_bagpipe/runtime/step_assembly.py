"""StepAssembler: the rows of one step, from the cache, prefetched fetches and demand gets.

Two phases, so that preparation runs ahead, off the training thread (`step_preparer.py`):

  * `prepare(t, plan) -> PreparedStep` — metadata only (no tensor op, no row value read or
    written): the issue of prefetches whose dependency committed since (so that step t's
    own become prefetched rather than demand), the cache query (hits at the version the
    step reads), the prefetched rows that serve misses, the keys left for the demand get,
    the admission of the misses (Belady over the window: soonest next use first, bypass
    when nothing resident is needed later), the placement and issue of later steps'
    prefetches, and the index plan that puts the staged rows in unique-key order;
  * `assemble(prepared) -> rows` — on the training thread: issue the demand get (its
    dependency may be the commit of the step just finished, so it cannot be issued ahead;
    on the CPU it writes its rows straight into the step's staging tensor), gather
    [hits | prefetched] into the staging tensor, wait for the demand rows, one gather into
    unique-key order, write the admitted rows into their slots; then retire the fetches the
    step used up.

With a cache, every row is staged with its optimizer state (the cache's `width`: the state
an admitted row needs for local updates comes with it); the step's rows are the weights.

Without a cache (read_mode ps) every unique key is fetched on demand into the step's rows.

Thread safety: both phases run with the controller's cache lock held (the assembler has no
lock of its own); `prepare` on the step preparer's thread or the training thread, `assemble`
on the training thread. Lock order: cache lock, then the PS port's lock (gets), never the
other way round. Row values (`DeviceCache`) are read and written by `assemble` only.

Invariants:
  1. Freshness: a hit is a slot at exactly the version dep(k, t); every other row comes from
     a get at the largest dependency step of its keys (ARCHITECTURE §1 inv. 1, 4).
  2. Accounting: hits + prefetch_served + demand_fetched = the step's unique keys (inv. 7).
  3. Unique destinations: admitted slots are distinct (the metadata's Admit contract), and
     each staged row is written once.
  4. ps aggregation: a key another rank also touches at step t is served but not admitted
     (its update is not known here, it is invalidated right after the step).
  5. Row values move only in `assemble`, in step order on the training thread: a slot that a
     later step's preparation reassigned still receives the earlier steps' writes first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchrec_bagpipe.runtime.access_plans import StepPlan
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.prefetch import PrefetchedPart, PrefetchScheduler
from torchrec_bagpipe.runtime.ps_port import Handle, PSPort

__all__ = ["PreparedStep", "StepAssembler"]

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class PreparedStep:
    """One step after preparation: where each of its unique keys' rows comes from.

    `assemble` stages the rows in a tensor `src` laid out [hits | prefetched | demand];
    `order` maps unique-key position -> row of `src` (None: `src` is already in unique-key
    order)."""

    t: int
    plan: StepPlan
    hit_slots: np.ndarray             # cache slots of the hits, in `src` order
    prefetched: list[PrefetchedPart]  # in `src` order, after the hits
    demand_keys: np.ndarray           # the demand get's keys (the last rows of `src`) ...
    demand_deps: np.ndarray           # ... and their dependency steps
    order: np.ndarray | None
    admit_pos: np.ndarray             # unique-key positions admitted to the cache ...
    admit_slots: np.ndarray           # ... and their (distinct) slots


class StepAssembler:
    def __init__(
        self,
        *,
        meta: Any,  # C.BagPipeCacheMetadata, or None without a cache
        cache: DeviceCache,
        prefetch: PrefetchScheduler,
        port: PSPort,
        metrics: RuntimeMetrics,
        dim: int,
        device: torch.device,
        window: int,
        collective: bool,
        write_backs: Any = None,  # WriteBackLog (write-back aggregation), else None
    ) -> None:
        self._meta = meta
        self._cache = cache
        self._prefetch = prefetch
        self._port = port
        self._metrics = metrics
        self._dim = dim
        # With a cache, rows travel with their optimizer state (the cache's row width).
        self._width = cache.width if meta is not None else dim
        self._with_state = self._width != dim
        self._device = device
        self._window = window  # batches planned ahead (BagPipeConfig.window_batches)
        self._collective = collective
        self._wb = write_backs

    # ---- phase 1: metadata and fetch issue ----------------------------------------------
    def prepare(self, t: int, plan: StepPlan) -> PreparedStep:
        """Decides where each row of step t comes from and issues its demand get.
        REQUIRES: the window entered up to the steps submitted (`enter_window`)."""
        if self._meta is None:
            return self._prepare_uncached(t, plan)
        meta = self._meta
        U, deps = plan.unique_keys, plan.deps
        if self._wb is not None:  # a row written back is read after its write-back's step
            deps = self._wb.deps(U, deps)
        n = U.size
        next_use = plan.next_use
        if self._prefetch.entered < t + self._window and next_use.size:
            next_use = np.where(next_use <= self._prefetch.entered, next_use, -1)
        # Prefetches whose dependency committed since the last issue (step t's included).
        self._prefetch.issue_ready()
        hit_pos, hit_slots, miss_pos, stale = meta.query(U, deps, next_use)
        nh = hit_pos.size
        # Prefetches of this step still queued (dependency not committed) become demand.
        self._prefetch.drop_queued(t)
        missing = np.zeros(n, dtype=bool)
        missing[miss_pos] = True
        parts = self._prefetch.prefetched_for(t, missing)
        nq = sum(p.upos.size for p in parts)
        d_pos = np.flatnonzero(missing) if nq else miss_pos
        # Admission, soonest next use first (none last): admitted rows are pinned for the
        # step, so the rows worth keeping claim slots before the ones worth less (Belady).
        a_pos = a_slots = _EMPTY
        # ps aggregation: a row another rank touches at this step is invalidated right after
        # it (its update is not known here), so it is served without taking a slot.
        cand = miss_pos if self._collective else miss_pos[~plan.shared[miss_pos]]
        if cand.size:
            miss_nu = next_use[cand]
            horizon = self._window + 1
            rank = np.where(miss_nu < 0, horizon, miss_nu - t)
            rank = rank.astype(np.int16 if horizon < (1 << 15) else np.int64)
            order = np.argsort(rank, kind="stable")
            mp = cand[order]
            a_idx, a_slots, evicted, a_bypassed = meta.admit(U[mp], deps[mp], miss_nu[order])
            a_pos = mp[a_idx]
            self._metrics.add(evictions=int(evicted.size), bypassed=int(a_bypassed.size))
            if self._wb is not None:
                # Placements take the free slots first, then one victim each in eviction
                # order: the last len(evicted) placements hold the victims' slots.
                self._wb.evicted(t, evicted, a_slots[a_slots.size - evicted.size:], a_slots)
        if stale:
            self._metrics.add(stale=int(stale))
        self._prefetch.place(t)
        self._prefetch.issue_ready()
        # The index plan: unique-key position -> row of src ([hits | prefetched | demand]).
        src_order = None
        if nh != n:
            src_order = np.empty(n, dtype=np.int64)
            if nh:
                src_order[hit_pos] = np.arange(nh)
            off = nh
            for part in parts:
                k = part.upos.size
                src_order[part.upos] = np.arange(off, off + k)
                off += k
            if d_pos.size:
                src_order[d_pos] = np.arange(off, n)
        return PreparedStep(t, plan, hit_slots, parts, U[d_pos], deps[d_pos], src_order,
                            a_pos, a_slots)

    def _prepare_uncached(self, t: int, plan: StepPlan) -> PreparedStep:
        return PreparedStep(t, plan, _EMPTY, [], plan.unique_keys, plan.deps, None,
                            _EMPTY, _EMPTY)

    def _record_dependency(self, t: int, demand_deps: np.ndarray) -> None:
        if t == 0:
            return
        if self._port.committed() < t - 1:
            if demand_deps.size and int(demand_deps.max()) >= t - 1:
                self._metrics.add(dependency_waits=1)
            else:
                self._metrics.add(skipped_dependency_waits=1)

    def _demand(self, t: int, keys: np.ndarray, deps: np.ndarray,
                out: torch.Tensor) -> Handle | None:
        """Issues the demand get of step t; on the CPU the rows land in `out` directly."""
        if not keys.size:
            return None
        uses = np.full(keys.size, t, dtype=np.int64)
        if self._device.type == "cpu":
            return self._port.get("demand", keys, deps, uses, out=out,
                                  with_state=self._with_state)
        return self._port.get("demand", keys, deps, uses, with_state=self._with_state)

    # ---- phase 2: tensor ops ------------------------------------------------------------
    def assemble(self, p: PreparedStep) -> torch.Tensor:
        """The step's rows (fp32 [U, dim] on the device, in unique-key order, fresh; without
        their optimizer state, which only the cache keeps).
        REQUIRES: the training thread, after every earlier step's row writes
        (`Aggregation.before_step(t)`)."""
        n = p.plan.unique_keys.size
        if self._wb is not None:  # the rows step t evicted, before their slots are refilled
            self._wb.send(p.t, self._cache, self._port)
        # Allocated here, on the training thread (and its current stream on CUDA).
        src = torch.empty(n, self._width, dtype=torch.float32, device=self._device)
        num_demand = p.demand_keys.size
        self._record_dependency(p.t, p.demand_deps)
        handle = self._demand(p.t, p.demand_keys, p.demand_deps, src[n - num_demand:])
        nh = p.hit_slots.size
        if nh:
            self._cache.gather(p.hit_slots, out=src[:nh])
        off = nh
        for part in p.prefetched:
            k = part.upos.size
            rows_f = self._prefetch.materialize(part.fetch)
            torch.index_select(rows_f, 0, self._cache.index(part.sel), out=src[off:off + k])
            off += k
        self._finish_demand(handle, num_demand, src[off:])
        rows = src if p.order is None else src.index_select(0, self._cache.index(p.order))
        if p.admit_slots.size:
            self._cache.fill(p.admit_slots, rows.index_select(0, self._cache.index(p.admit_pos)))
        if self._with_state:
            rows = rows[:, :self._dim].contiguous()
        if self._meta is not None:
            self._prefetch.retire(p.t)
            self._prefetch.materialize_ready(p.t)
        nq = off - nh
        self._metrics.add(
            accesses=n,
            hits=nh,
            prefetch_served=nq,
            demand_fetched=num_demand,
            demand_gets=int(num_demand > 0),
        )
        return rows

    def _finish_demand(self, handle: Handle | None, n: int, out: torch.Tensor) -> None:
        """Waits for the demand rows and puts them in `out` (where a CPU get wrote them)."""
        if handle is None:
            return
        t0 = time.perf_counter()
        rows = self._port.wait_rows(handle, n, self._with_state)
        self._metrics.add(fetch_wait_s=time.perf_counter() - t0)
        if rows.data_ptr() != out.data_ptr():
            out.copy_(rows, non_blocking=True)
