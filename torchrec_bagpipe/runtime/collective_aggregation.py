"""CollectiveAggregation: the ranks all-reduce each step's gradients (``collective``).

After step t the gradients over the global union of the step's keys (every rank knows it
from the exchanged ids) are all-reduced in two parts: S_now, the rows step t + 1 reads, first
(applied to the resident rows at the start of step t + 1, before anything reads them), then
S_later, the rest, on the communication worker with the commit, overlapping the next forward.
Every rank updates all of its resident affected rows, weights and optimizer state, at the
step's learning rate (`DeviceCache.apply_gradients_`), so no row is invalidated; each union
row's designated rank (union index mod W) commits it, so the PS receives every row's summed
gradient exactly once. One buffer per step holds the union rows [S_now | S_later], each part
grouped by designated rank (the same layout on every rank): the gradient is scattered into it
once, the all-reduces reduce its two parts in place, the local updates read them, and the
commit sends this rank's two runs (one copy of 1/W of the rows).

The metadata part (`plan_finish`: the S_now / S_later split, the resident slots of each,
their version t, the pins, the gather plans and the designated keys) depends on the plan
only, so it runs when step t is prepared; `finish` does the tensor work and the submissions.

Thread safety: `before_step`, `finish`, `drain` and `close` run on the training thread;
`plan_finish` runs with the controller's cache lock held (step preparer or training thread);
the S_now all-reduce and the S_later task (`_later_task`: all-reduce, local update, commit)
run on the communication worker, FIFO, so the S_later task of step t runs after its S_now
all-reduce. Row values are written by the training thread (the S_now update, without the
cache lock: only the training thread and the S_later task write values) and by the S_later
task (invariant 2).

Invariants:
  1. S_now of step t is applied before step t + 1 reads (`before_step(t + 1)` joins it first).
  2. The resident rows of S_later(t) are pinned through step t + 1 and not read at t + 1, so
     neither the training thread nor eviction touches them while the worker updates them;
     `before_step(t + 2)` joins the update before step t + 2's rows are written or read
     (its preparation may already have reassigned their slots: metadata only).
  3. Versions are set to t under the cache lock in `plan_finish`, before any later step is
     prepared.
  4. Every worker task is joined (`before_step` polls, `drain` waits) or cancelled (`close`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from torchrec_bagpipe.runtime.access_plans import StepPlan
from torchrec_bagpipe.runtime.aggregation import Aggregation
from torchrec_bagpipe.runtime.collectives import Collectives
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.ps_port import PSPort
from torchrec_bagpipe.runtime.worker import MeteredWorker

__all__ = ["CollectiveAggregation", "CollectivePlan"]

_EMPTY = np.zeros(0, dtype=np.int64)


class WorkerTask(NamedTuple):
    """The S_later task (all-reduce, local update, commit) of one step on the worker."""

    step: int
    future: Future


class CollectivePlan(NamedTuple):
    """What `plan_finish` decided for step t. The step's gradient buffer holds the union
    rows [S_now | S_later], each part grouped by designated rank."""

    grad_dest: np.ndarray    # buffer row of each unique key's gradient row
    size: int                # rows of the buffer (the union)
    n_now: int               # S_now rows: the buffer's first part
    now_run: tuple[int, int]    # buffer rows this rank commits, in the S_now part ...
    later_run: tuple[int, int]  # ... and in the S_later part
    now_slots: np.ndarray    # resident slots of S_now rows ...
    now_rows: np.ndarray     # ... and their rows in the S_now part
    later_slots: np.ndarray  # resident (pinned) slots of S_later rows ...
    later_sel: np.ndarray    # ... and their rows in the S_later part
    keys: np.ndarray         # the keys this rank commits (its S_now run, then S_later run)
    commit_rows: np.ndarray | None = None  # the buffer rows of `keys`, when not those runs
                                           # (write-back: only rows no cache holds)


@dataclass
class NowUpdate:
    """The S_now all-reduce of one step, applied to the resident rows before the next step
    reads them."""

    future: Future
    grads: torch.Tensor      # reduced in place by the worker
    slots: np.ndarray        # resident slots of S_now rows
    grad_rows: np.ndarray    # their rows in `grads`
    lr: float                # the step's learning rate


class CollectiveAggregation(Aggregation):
    def __init__(
        self,
        *,
        meta: Any,  # C.BagPipeCacheMetadata, or None without a cache
        cache: DeviceCache,
        cache_lock: threading.RLock,
        port: PSPort,
        metrics: RuntimeMetrics,
        collectives: Collectives,
        worker: MeteredWorker,
        window_end: Callable[[], int],
        rank: int,
        world_size: int,
        dim: int,
        timeout: float,
    ) -> None:
        self._meta = meta
        self._cache = cache
        self._cache_lock = cache_lock
        self._port = port
        self._metrics = metrics
        self._coll = collectives
        self._worker = worker
        self._window_end = window_end  # the end of the window's fixed part: the same on
                                       # every rank (an S_now split all ranks agree on)
        self._rank = rank
        self._world_size = world_size
        self._dim = dim
        self._timeout = timeout
        self._tasks: deque[WorkerTask] = deque()     # S_later tasks not known to be done
        self._later_pins: dict[int, Future] = {}     # step -> its S_later task (pinned rows)
        self._now_update: NowUpdate | None = None    # the last step's S_now

    # ---- the step -----------------------------------------------------------------------
    def before_step(self, t: int) -> None:
        while self._tasks and self._tasks[0].future.done():
            self._tasks.popleft().future.result()
        self._port.poll_commits()
        self._apply_now_update()
        # S_later updates of steps <= t - 2 must land before their pins expire.
        for s in [s for s in self._later_pins if s <= t - 2]:
            self._later_pins.pop(s).result(timeout=self._timeout)

    def plan_finish(self, t: int, plan: StepPlan) -> CollectivePlan:
        union = plan.union_keys
        nu = union.size
        s_now = plan.s_now if self._window_end() >= t + 1 else np.ones(nu, dtype=bool)
        now_idx = np.flatnonzero(s_now)
        later_idx = np.flatnonzero(~s_now)
        # The step's one gradient buffer: union rows [S_now | S_later], each part grouped by
        # designated rank (union index mod W), the same layout on every rank. Each all-reduce
        # reduces a contiguous part in place, and the rows this rank commits are one
        # contiguous run in each part (no gather).
        r = self._rank
        owner = np.arange(nu) % self._world_size
        now_ord = now_idx[np.argsort(owner[now_idx], kind="stable")]
        later_ord = later_idx[np.argsort(owner[later_idx], kind="stable")]
        n_now = now_ord.size
        row = np.empty(nu, dtype=np.int64)  # union index -> buffer row
        row[now_ord] = np.arange(n_now)
        row[later_ord] = np.arange(n_now, nu)
        a_now, b_now = np.searchsorted(owner[now_ord], [r, r + 1])
        a_later, b_later = np.searchsorted(owner[later_ord], [r, r + 1])
        commit_keys = union[np.r_[now_ord[a_now:b_now], later_ord[a_later:b_later]]]
        # The metadata calls below see the keys in union order, as before the layout.
        later_slots = later_sel = _EMPTY
        now_slots = now_rows = _EMPTY
        if self._meta is not None:
            with self._cache_lock:
                slots = self._meta.lookup(union[now_idx])
                have = np.flatnonzero(slots >= 0)
                now_slots, now_rows = slots[have], row[now_idx[have]]
                if now_slots.size:
                    self._meta.set_version(now_slots, t)
                lslots = self._meta.lookup(union[later_idx])
                sel = np.flatnonzero(lslots >= 0)
                later_slots, later_sel = lslots[sel], row[later_idx[sel]] - n_now
                if later_slots.size:
                    self._meta.set_version(later_slots, t)
                    self._meta.pin(later_slots, t + 1)
                self._metrics.add(local_updates=int(now_slots.size + later_slots.size))
        return CollectivePlan(row[plan.union_pos], nu, n_now, (int(a_now), int(b_now)),
                              (n_now + int(a_later), n_now + int(b_later)), now_slots,
                              now_rows, later_slots, later_sel, commit_keys)

    def finish(self, t: int, plan: StepPlan, grad: torch.Tensor, planned: CollectivePlan,
               lr: float) -> None:
        p = planned
        dev = grad.device
        # The union rows' gradients (zero where this rank has none), scattered once into the
        # buffer that the all-reduces reduce in place, the updates read and the commit sends.
        buf = torch.zeros(p.size, self._dim, dtype=grad.dtype, device=dev)
        if p.grad_dest.size:
            buf.index_copy_(0, torch.from_numpy(p.grad_dest).to(dev), grad)
        g_now = buf[:p.n_now]
        g_later = buf[p.n_now:]
        if p.n_now:
            fut = self._worker.submit(self._coll.all_reduce_sum_, g_now)
            self._metrics.add(allreduce_payload_bytes=g_now.numel() * 4, collectives_issued=1)
            self._now_update = NowUpdate(fut, g_now, p.now_slots, p.now_rows, lr)
        later_slots, later_sel = p.later_slots, p.later_sel

        def later_part() -> torch.Tensor:
            # Runs on the worker after the S_now all-reduce (FIFO), so g_now is reduced.
            if g_later.shape[0]:
                self._coll.all_reduce_sum_(g_later)
                self._metrics.add(allreduce_payload_bytes=g_later.numel() * 4,
                                  collectives_issued=1)
                # No lock: these slots are pinned through t + 1 (invariant 2).
                self._cache.apply_gradients_(later_slots, g_later, later_sel, lr=lr)
            if p.commit_rows is not None:
                return buf.index_select(0, torch.from_numpy(p.commit_rows).to(dev)).cpu()
            runs = [buf[a:b] for a, b in (p.now_run, p.later_run) if b > a]
            if not runs:
                return buf[:0].cpu()
            return (runs[0] if len(runs) == 1 else torch.cat(runs)).cpu()

        fut = self._worker.submit(self._later_task, t, torch.from_numpy(p.keys), later_part, lr,
                                  plan.evicted)
        self._tasks.append(WorkerTask(t, fut))
        if later_slots.size:
            self._later_pins[t] = fut

    def _later_task(self, t: int, keys: torch.Tensor,
                    produce: Callable[[], torch.Tensor], lr: float,
                    evicted: np.ndarray | None = None) -> None:
        """Runs on the worker: the S_later reduce and update, then commit t at `lr` (with the
        keys evicted at t's boundary: virtual tables)."""
        grads = produce()
        self._port.commit(t, keys, grads, lr, evicted)

    def _apply_now_update(self) -> None:
        """Waits for the last step's S_now all-reduce and applies it to the resident rows
        (before anything reads them)."""
        upd = self._now_update
        if upd is None:
            return
        self._now_update = None
        t0 = time.perf_counter()
        upd.future.result(timeout=self._timeout)
        self._metrics.add(collective_wait_s=time.perf_counter() - t0)
        if upd.slots.size:
            self._cache.apply_gradients_(upd.slots, upd.grads, upd.grad_rows, lr=upd.lr)

    # ---- lifetime -----------------------------------------------------------------------
    def drain(self) -> None:
        self._apply_now_update()
        while self._tasks:
            self._tasks[0].future.result(timeout=self._timeout)
            self._tasks.popleft()
        self._later_pins.clear()
        self._port.drain_commits()

    def close(self) -> None:
        for task in self._tasks:
            task.future.cancel()
        if self._now_update is not None:
            self._now_update.future.cancel()
