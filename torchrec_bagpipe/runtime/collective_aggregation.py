"""CollectiveAggregation: the ranks all-reduce each step's gradients (``collective``).

After step t the gradients over the global union of the step's keys (every rank knows it
from the exchanged ids) are all-reduced in two parts: S_now, the rows step t + 1 reads, first
(applied to the resident rows at the start of step t + 1, before anything reads them), then
S_later, the rest, on the communication worker with the commit, overlapping the next forward.
Every rank updates all of its resident affected rows, weights and optimizer state, at the
step's learning rate (`DeviceCache.apply_gradients_`), so no row is invalidated; each union
row's designated rank (union index mod W) commits it, so the PS receives every row's summed
gradient exactly once.

Thread safety: `before_step`, `finish`, `drain` and `close` run on the training thread; the
S_now all-reduce and the S_later task (`_later_task`: all-reduce, local update, commit) run on
the communication worker, FIFO, so the S_later task of step t runs after its S_now all-reduce.
The training thread takes the controller's cache lock for the metadata (versions, pins) and
for the S_now update; the S_later update runs without it (invariant 2).

Invariants:
  1. S_now of step t is applied before step t + 1 reads (`before_step(t + 1)` joins it first).
  2. The resident rows of S_later(t) are pinned through step t + 1 and not read at t + 1, so
     neither the training thread nor eviction touches them while the worker updates them;
     `before_step(t + 2)` joins the update before their pins expire.
  3. Versions are set to t under the cache lock in `finish`, before any later step queries.
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
from torchrec_bagpipe.runtime.worker import CommWorker

__all__ = ["CollectiveAggregation"]

_EMPTY = np.zeros(0, dtype=np.int64)


class WorkerTask(NamedTuple):
    """The S_later task (all-reduce, local update, commit) of one step on the worker."""

    step: int
    future: Future


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
        worker: CommWorker,
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
        self._window_end = window_end  # the last step in the lookahead window
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

    def finish(self, t: int, plan: StepPlan, grad: torch.Tensor, lr: float) -> None:
        union = plan.union_keys
        nu = union.size
        s_now = plan.s_now if self._window_end() >= t + 1 else np.ones(nu, dtype=bool)
        now_idx = np.flatnonzero(s_now)
        later_idx = np.flatnonzero(~s_now)
        dev = grad.device
        # Each union row's gradient row (or the zero row past the end): one gather each.
        padded = torch.cat([grad, torch.zeros(1, self._dim, dtype=grad.dtype, device=dev)])
        src_of = np.full(nu, plan.unique_keys.size, dtype=np.int64)
        src_of[plan.union_pos] = np.arange(plan.union_pos.size)

        def dense(idx: np.ndarray) -> torch.Tensor:
            return padded.index_select(0, torch.from_numpy(src_of[idx]).to(dev))

        g_now = dense(now_idx)
        g_later = dense(later_idx)
        later_slots = later_sel = _EMPTY
        now_slots = now_rows = _EMPTY
        if self._meta is not None:
            with self._cache_lock:
                slots = self._meta.lookup(union[now_idx])
                have = np.flatnonzero(slots >= 0)
                now_slots, now_rows = slots[have], have
                if now_slots.size:
                    self._meta.set_version(now_slots, t)
                lslots = self._meta.lookup(union[later_idx])
                later_sel = np.flatnonzero(lslots >= 0)
                later_slots = lslots[later_sel]
                if later_slots.size:
                    self._meta.set_version(later_slots, t)
                    self._meta.pin(later_slots, t + 1)
                self._metrics.add(local_updates=int(now_slots.size + later_slots.size))
        if now_idx.size:
            fut = self._worker.submit(self._coll.all_reduce_sum_, g_now)
            self._metrics.add(allreduce_payload_bytes=g_now.numel() * 4, collectives_issued=1)
            self._now_update = NowUpdate(fut, g_now, now_slots, now_rows, lr)
        designated = (np.arange(nu) % self._world_size) == self._rank
        d_now = np.flatnonzero(designated[now_idx])
        d_later = np.flatnonzero(designated[later_idx])
        keys_t = torch.from_numpy(
            np.concatenate([union[now_idx][d_now], union[later_idx][d_later]]))

        def later_part() -> torch.Tensor:
            # Runs on the worker after the S_now all-reduce (FIFO), so g_now is reduced.
            if later_idx.size:
                self._coll.all_reduce_sum_(g_later)
                self._metrics.add(allreduce_payload_bytes=g_later.numel() * 4,
                                  collectives_issued=1)
                # No lock: these slots are pinned through t + 1 (invariant 2).
                self._cache.apply_gradients_(later_slots, g_later, later_sel, lr=lr)
            parts = [g_now.index_select(0, torch.from_numpy(d_now).to(dev)),
                     g_later.index_select(0, torch.from_numpy(d_later).to(dev))]
            return torch.cat(parts).cpu()

        fut = self._worker.submit(self._later_task, t, keys_t, later_part, lr)
        self._tasks.append(WorkerTask(t, fut))
        if later_slots.size:
            self._later_pins[t] = fut

    def _later_task(self, t: int, keys: torch.Tensor,
                    produce: Callable[[], torch.Tensor], lr: float) -> None:
        """Runs on the worker: the S_later reduce and update, then commit t at `lr`."""
        grads = produce()
        self._port.commit(t, keys, grads, lr)

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
            with self._cache_lock:
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
