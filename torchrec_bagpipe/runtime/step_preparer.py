"""StepPreparer: a step's metadata, prepared while the previous step runs, on its own thread.

Everything about step t that does not need the gradients of step t - 1 is prepared ahead:
the plans of the window (online: the wait for the ID exchanges), the window entry
(`PrefetchScheduler.enter_window`), the cache query and admission, the prefetched rows that
serve misses, the keys left for the demand get, the index plans (`StepAssembler.prepare`),
the placement and issue of later prefetches, and the metadata effects of step t's own
aggregation (`Aggregation.plan_finish`: versions, invalidations, pins). The training thread
is left with the tensor work (`StepAssembler.assemble`, `Aggregation.finish`).

A step's preparation depends on the earlier steps only through the metadata, and the
metadata effects of step t - 1's aggregation are a function of its plan, applied at the end
of step t - 1's preparation. So preparing step t while step t - 1 runs makes exactly the
decisions the training thread would make at next_step(t): no prepared row can be
invalidated by a later commit, and nothing needs patching. Row values move only on the
training thread, in step order (`step_assembly.py` invariant 5), so a slot that the
preparation of step t reassigns still receives step t - 1's update before its new row.

When: step s is prepared ahead (`launch`) once next_step(s - 1) has returned and its window
is full (batch s + window submitted: `BagPipeConfig.window_batches`), so the window, and
every decision, is the one next_step(s) would see. Otherwise (the end of the data, batches
submitted late, or no cache: read_mode ps) next_step(s) prepares it on the training thread
(`take`), with the same code.

Thread safety: `launch`, `take`, `issue_later`, `discard`, `close` and `ahead` are called by
the training thread. The preparation runs on this preparer's thread (one FIFO thread per
controller) or on the training thread, never on both at once for the same step; it takes
the controller's cache lock around the metadata (after the ID exchange waits, which hold no
lock). Each task's run time counts as `runtime_worker_s` (`MeteredWorker`).

Invariants:
  1. At most one step is prepared ahead, and only step `next + 1` while step `next` runs
     (or step `next` between steps): steps are prepared in order, each exactly once
     (`discard` forgets one whose metadata was cleared; it is prepared again).
  2. Every task is waited for (bounded) before its result is used, before `discard` returns
     and in `close`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np

from torchrec_bagpipe.runtime.aggregation import Aggregation
from torchrec_bagpipe.runtime.id_exchange import IdExchange
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.prefetch import PrefetchScheduler
from torchrec_bagpipe.runtime.step_assembly import PreparedStep, StepAssembler
from torchrec_bagpipe.runtime.worker import CommWorker, MeteredWorker, wait_task

__all__ = ["PreparedWork", "StepPreparer"]


class PreparedWork(NamedTuple):
    """One prepared step: where its rows come from, and its aggregation's metadata result."""

    step: PreparedStep
    finish: Any  # `Aggregation.plan_finish`'s result, for `Aggregation.finish`


class StepPreparer:
    def __init__(
        self,
        *,
        meta: Any,  # C.BagPipeCacheMetadata, or None without a cache
        plans: IdExchange,
        prefetch: PrefetchScheduler,
        assembler: StepAssembler,
        aggregation: Aggregation,
        cache_lock: threading.RLock,
        metrics: RuntimeMetrics,
        window: int,
        timeout: float,
        name: str,
    ) -> None:
        self._meta = meta
        self._plans = plans
        self._prefetch = prefetch
        self._assembler = assembler
        self._agg = aggregation
        self._cache_lock = cache_lock
        self._window = window  # batches planned ahead (BagPipeConfig.window_batches)
        self._metrics = metrics
        # The preparation waits for up to window + 1 ID exchanges, each bounded.
        self._timeout = timeout * (window + 2)
        self._thread = CommWorker(name)
        self._worker = MeteredWorker(self._thread, metrics)
        self._ahead: tuple[int, Future] | None = None  # the step prepared ahead
        self._tasks: list[Future] = []                 # other tasks not known to be done
        # Virtual tables: the keys evicted at the previous prepared step's boundary, dropped
        # from the cache when the next step is prepared, before its query (an eviction is a
        # write at that step: docs/virtual_tables.md).
        self._evicted = np.zeros(0, dtype=np.int64)

    @property
    def ahead(self) -> int | None:
        """The step prepared ahead (its preparation may still run), or None."""
        return self._ahead[0] if self._ahead is not None else None

    # ---- the rule -----------------------------------------------------------------------
    def launch(self, s: int, submitted: int) -> None:
        """Starts preparing step s on the preparer's thread if its window is full (with a
        cache: without one a step's preparation is only its plan, cheaper than the hand-off).
        REQUIRES: next_step(s - 1) returned (or s is the next step and none runs)."""
        if (self._meta is None or self._ahead is not None
                or submitted - 1 < s + self._window):
            return
        self._ahead = (s, self._worker.submit(self.prepare, s, submitted))

    def take(self, t: int, submitted: int) -> PreparedWork:
        """Step t prepared: the result of the ahead preparation, or prepared now."""
        ahead = self._ahead
        if ahead is not None:
            self._ahead = None
            s, fut = ahead
            if s != t:
                raise RuntimeError(f"step {s} was prepared ahead, step {t} is next")
            return wait_task(fut, self._timeout, lambda w: self._stuck(t, w))
        return self.prepare(t, submitted)

    def _stuck(self, t: int, waited: float) -> str:
        """Why the preparation of step t did not finish within `waited` seconds: the ID
        exchange it waits for, naming the ranks, or else the step itself."""
        return self._plans.waiting_for(waited) or (
            f"rank {self._plans.rank}: preparing step {t} ahead did not complete within "
            f"{waited:g} s")

    def prepare(self, t: int, submitted: int) -> PreparedWork:
        """Prepares step t with the window of `submitted` batches (any thread)."""
        upto = min(t + self._window, submitted - 1)
        self._plans.absorb(t, upto)
        with self._cache_lock:
            if self._meta is not None:
                self._meta.advance(t)
                if self._evicted.size:
                    freed = self._meta.invalidate(self._evicted)
                    self._metrics.add(invalidations=int(freed.size))
            plan = self._plans.plan(t)
            self._prefetch.enter_window(t, upto, self._plans.plan, plan.unique_keys.size)
            self._metrics.add(window_steps=max(self._prefetch.entered - t, 0))
            self._evicted = plan.evicted
            prepared = self._assembler.prepare(t, plan)
            finish = self._agg.plan_finish(t, plan)
        return PreparedWork(prepared, finish)

    def drop_evicted(self) -> None:
        """Drops the last prepared step's evicted keys from the cache now (flush: its commit
        is done). REQUIRES: no preparation running."""
        if self._meta is None or not self._evicted.size:
            return
        with self._cache_lock:
            freed = self._meta.invalidate(self._evicted)
            self._metrics.add(invalidations=int(freed.size))
            self._evicted = self._evicted[:0]

    def issue_later(self) -> None:
        """Issues the prefetches whose dependency committed, on the preparer's thread."""
        if self._meta is None:
            return
        running = []
        for f in self._tasks:
            if f.done():
                f.result()  # raises a failed task's error
            else:
                running.append(f)
        self._tasks = running
        self._tasks.append(self._worker.submit(self._issue_ready))

    def _issue_ready(self) -> None:
        with self._cache_lock:
            self._prefetch.issue_ready()

    # ---- lifetime -----------------------------------------------------------------------
    def discard(self) -> None:
        """Waits for every task and forgets the step prepared ahead (its metadata is about to
        be cleared); raises a task's error."""
        ahead, self._ahead = self._ahead, None
        tasks = self._tasks + ([ahead[1]] if ahead is not None else [])
        self._tasks = []
        for fut in tasks:
            wait_task(fut, self._timeout, lambda w: self._plans.waiting_for(w) or (
                f"rank {self._plans.rank}: a step preparation task did not complete within "
                f"{w:g} s"))

    def close(self) -> None:
        """Waits for every task (bounded; errors are the caller's to ignore) and stops the
        thread."""
        try:
            self.discard()
        finally:
            self._thread.shutdown()
