"""BagPipeController: one rank's bounded, coherent, lookahead-prefetched cache of one fused table.

The TorchRec layer drives it (ARCHITECTURE §4)::

    ctl.prescan(local_trace)     # optional, before training (a collective)
    ctl.submit(keys)             # each batch entering the lookahead window (online: a collective)
    step = ctl.next_step()       # oldest submitted batch: unique keys, inverse, rows (|U| x dim)
    ctl.finish_step(step, grad, lr=lr)  # |U| x dim row gradient at the step's learning rate:
                                        # commit + keep the cache coherent
    ctl.flush(); ctl.metrics(); ctl.invalidate_all(); ctl.close()
    ctl.drain()                  # reads outside the step sequence: commits of finished steps
    ctl.check_submit(keys)       # would `submit(keys)` accept this batch? (no side effect)

Step order: steps run strictly one after another (next_step(t), finish_step(t),
next_step(t + 1), ...); batch t must have been submitted before next_step(t). Every rank
makes the same sequence of calls (the same number of submits before each next_step): the
window a step sees, and hence every cache decision, is a function of that sequence, so the
cache contents are deterministic. Only *when* a fetch is issued depends on commit timing.

Optimizers: the PS applies the table's optimizer (`ps.optimizer_spec.OptimizerSpec`: SGD,
Adagrad, row-wise Adagrad, Adam) once per row per step at the learning rate the step's
commit carries (`finish_step(..., lr=)`; for Adam the bias-corrected step size, so the
runtime is step-agnostic). The cache keeps each resident row's optimizer state next to its
weights, fetched with the row, so the local updates below are the PS's arithmetic on both
(`row_update.py`).

Coherence (PS-owned BagPipe; invariants in docs/ARCHITECTURE.md §1). A resident row carries a
version: the step whose commit its values reflect (-1: initial). Step t reads row k at version
dep(k, t), the last global step < t that touched k. The pieces, one file each:
  * the plans (`access_plans.py`) from every rank's ids (`id_exchange.py`: prescan, or an
    online exchange per submitted batch on the communication worker);
  * prefetch (`prefetch.py`): when a step enters the window its keys become candidates,
    fetched at most `prepared_batches` steps ahead, once their dependency committed
    (invariant 4); the rows wait in their fetch's buffer until their step;
  * the step's rows (`step_assembly.py`): hits | prefetched | demand gets; the misses are
    admitted soonest-next-use first (Belady's MIN with bypass over the window), so
    prefetching changes when rows are fetched, never what is cached;
  * aggregation (`aggregation.py`): ``ps`` (`ps_aggregation.py`: local update of rows only
    this rank touched, invalidation of the others, commit), ``collective``
    (`collective_aggregation.py`: all-reduce over the global union, S_now first) or
    ``writeback`` (`writeback_aggregation.py`: replicated plans, so every cache holds the
    same rows; resident rows are updated in the caches only and written back when evicted);
  * the PS client behind one port (`ps_port.py`), the row values (`device_cache.py`), the
    native metadata (`C.BagPipeCacheMetadata`), the counters (`metrics.py`).
A forward waits for a commit only through a fetch whose dependency is that commit; each
commit is submitted only after its predecessor committed.

Thread safety: call the controller from one thread (the training thread); `metrics()` may
also be called from another. It runs collectives (and collective aggregation's commit
submissions) on a communication worker per `Collectives` instance (`worker.py`: shared by the
controllers of one rank, FIFO), so that instance must not be used by anything else while
controllers are open. The metadata of step t + 1 is prepared while step t runs, on the step
preparer's thread (`step_preparer.py`, one per controller); the training thread keeps the
tensor work: the step's gathers, the demand get and its wait, the cache writes, the
gradient's local updates and commit. Locks:
  * `_cache_lock` (this file; reentrant) guards the cache metadata and the prefetch
    scheduler: a step's preparation holds it (after the ID exchange waits) on whichever
    thread prepares it, the training thread around a step's assembly (including the wait for
    the step's rows), `invalidate_all` and `close`; `metrics()` around the metadata's stats.
    Row values (`DeviceCache`) are written by the training thread only (and by the worker on
    pinned S_later rows, see `collective_aggregation.py`); the preparer never touches them.
  * `IdExchange._plan_lock` guards the online planner (the worker adds steps while plans are
    read).
  * `PSPort._client_lock` serializes PS client calls (gets, committed step, ps commits;
    worker: collective commits).
  * `RuntimeMetrics` has a lock of its own around each update.

Invariants:
  1. Lock order: `_cache_lock`, then any one of the plan lock, the client lock, the metrics
     lock. Those three are leaves: none is held while another lock is taken, or while
     waiting for a handle or a future.
  2. At most one step is active (`_active`): next_step(t) and finish_step(t) alternate.
  3. A failed call (other than an argument error) sets `_failed`: every later call raises
     ControllerError; `close()` still releases every resource.
  4. Step preparation (plans, window entry, metadata, prefetch issue, the aggregation's
     metadata: `StepPreparer.prepare`) runs no tensor op; the staging tensor, the demand get,
     the step's gathers, waits for rows and cache writes are `StepAssembler.assemble`'s, on
     the training thread, in step order.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.config import ROWS_PER_CACHE_UNIT, BagPipeConfig
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.runtime.access_plans import StepPlan, as_key_array
from torchrec_bagpipe.runtime.aggregation import Aggregation
from torchrec_bagpipe.runtime.collective_aggregation import CollectiveAggregation
from torchrec_bagpipe.runtime.collectives import Collectives
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.runtime.eviction import VIRTUAL_AUTO_CACHE_ROWS, EvictionSpec
from torchrec_bagpipe.runtime.id_exchange import IdExchange
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.prefetch import PrefetchScheduler
from torchrec_bagpipe.runtime.ps_aggregation import PSAggregation
from torchrec_bagpipe.runtime.ps_port import FetchObserver, Handle, PSClientLike, PSPort
from torchrec_bagpipe.runtime.step_assembly import StepAssembler
from torchrec_bagpipe.runtime.step_preparer import StepPreparer
from torchrec_bagpipe.runtime.worker import MeteredWorker, acquire_worker, release_worker
from torchrec_bagpipe.runtime.writeback_aggregation import WritebackAggregation, WriteBackLog

__all__ = ["BagPipeController", "ControllerError", "Handle", "PSClientLike", "Step"]


def _check_lr(lr: Any, what: str) -> float:
    """A learning rate: a finite real >= 0 (a warm-up may start at 0)."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)):
        raise TypeError(f"{what} must be a float, got {type(lr).__name__}")
    lr = float(lr)
    if not (np.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"{what} must be finite and >= 0, got {lr}")
    return lr


class ControllerError(RuntimeError):
    """The controller failed earlier (a PS or collective error); it cannot continue."""


@dataclass
class Step:
    """One rank's batch at one global step, ready for the forward."""

    step: int
    keys: torch.Tensor         # the batch's fused keys (CPU int64), as submitted
    unique_keys: torch.Tensor  # CPU int64 [U], first-occurrence order
    inverse: torch.Tensor      # int64 [B] on the device: batch position -> row of `rows`
    rows: torch.Tensor         # fp32 [U, dim] on the device, a leaf that requires grad
    plan: StepPlan


class BagPipeController:
    """One rank's BagPipe runtime for one fused table (see the module docstring).

    `ps` is this rank's client of the table (the PS client's dim and optimizer must be the
    controller's); `lr` the learning rate of a `finish_step` that passes none; `start_step`
    the table's committed step when the client's session opened (-1: a fresh table; a
    resumed job's checkpoint step): the controller numbers its steps from 0 and its step t
    is PS step ``t + start_step + 1`` (`ps_port.py`).
    """

    def __init__(
        self,
        config: BagPipeConfig,
        *,
        rank: int,
        world_size: int,
        dim: int,
        num_keys: int,
        lr: float,
        ps: PSClientLike,
        collectives: Collectives,
        device: torch.device | str | None = None,
        optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
        start_step: int = -1,
        eviction: EvictionSpec | None = None,
    ) -> None:
        if not isinstance(config, BagPipeConfig):
            raise TypeError(f"config must be a BagPipeConfig, got {type(config).__name__}")
        config.validate()
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if num_keys < 1:
            raise ValueError(f"num_keys must be >= 1, got {num_keys}")
        lr = _check_lr(lr, "lr")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < -1:
            raise ValueError(f"start_step must be an int >= -1, got {start_step!r}")
        spec = OptimizerSpec.of(optimizer)
        if eviction is not None and not isinstance(eviction, EvictionSpec):
            raise TypeError(f"eviction must be an EvictionSpec or None, got "
                            f"{type(eviction).__name__}")
        self.eviction = eviction  # a virtual table's rule (runtime/eviction.py); None: a table
        if eviction is not None and config.bagpipe_aggregation == "writeback":
            raise ValueError(
                "bagpipe_aggregation 'writeback' does not run virtual tables (an evicted row's "
                "write-back would race its erasure); use 'ps' or 'collective' for them"
            )
        if getattr(collectives, "rank", rank) != rank or getattr(
            collectives, "world_size", world_size
        ) != world_size:
            raise ValueError(
                f"collectives is rank {collectives.rank} of {collectives.world_size}, the "
                f"controller rank {rank} of {world_size}"
            )
        ps_dim = getattr(ps, "dim", dim)
        if ps_dim != dim:
            raise ValueError(f"the PS client has dim {ps_dim}, the controller dim {dim}")
        ps_spec = getattr(ps, "optimizer", spec)
        if ps_spec != spec:
            raise ValueError(
                f"the PS client's table runs optimizer {ps_spec}, the controller {spec}"
            )
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.dim = dim
        self.num_keys = num_keys
        self.lr = lr
        self.optimizer = spec
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._coll = collectives
        self._timeout = float(config.ps_timeout)
        self.metrics_ = RuntimeMetrics()
        self._wire(ps, start_step)
        self._finish_plan: object = None  # the active step's Aggregation.plan_finish result
        self._failed: BaseException | None = None
        self._closed = False
        self._submitted = 0
        self._next = 0
        self._active: Step | None = None
        self._local_keys: deque[np.ndarray] = deque()  # submitted, not yet run

    def _wire(self, ps: PSClientLike, start_step: int) -> None:
        """Builds the pieces (module docstring) and connects them."""
        config, rank, world_size, dim = self.config, self.rank, self.world_size, self.dim
        num_keys, spec, collectives = self.num_keys, self.optimizer, self._coll
        writeback = config.bagpipe_aggregation == "writeback"
        self._replicated = writeback  # plans are the union's (step_planner.h invariant 10)
        collective = writeback or config.bagpipe_aggregation == "collective"
        cached = config.read_mode == "bagpipe"
        self._lookahead = config.lookahead if cached else 0
        # Batches submitted and planned ahead: the adaptive window's bound, else lookahead.
        self._window = config.window_batches
        divide = config.resolved_gradient_division()
        virtual = self.eviction is not None
        if cached:
            # A virtual table's num_keys is an id space: the automatic size takes a bounded
            # row count instead (VIRTUAL_AUTO_CACHE_ROWS).
            rows = min(num_keys, VIRTUAL_AUTO_CACHE_ROWS) if virtual else num_keys
            units = config.cache_rows(rows) // ROWS_PER_CACHE_UNIT
            # key_bound: the table's rows (a direct key index when small enough; an id
            # outside the table is a ValueError instead of a silent cache entry).
            self._meta = C.BagPipeCacheMetadata(units, config.eviction_policy,
                                                key_bound=num_keys)
            capacity = self._meta.capacity_rows
        else:
            self._meta = None
            capacity = 0
        self._dev = DeviceCache(capacity, dim, self.device, world_size=world_size, divide=divide,
                                optimizer=spec)
        self._cache_lock = threading.RLock()
        # fp32 weights and optimizer state of one row (a virtual table's live_bytes).
        self._row_bytes = 4 * (dim + spec.state_dim(dim))
        self._port = PSPort(ps, dim=dim, state_dim=spec.state_dim(dim), timeout=self._timeout,
                            metrics=self.metrics_, start_step=start_step,
                            send_evictions=virtual and rank == 0)
        self._worker = MeteredWorker(acquire_worker(collectives), self.metrics_)
        log = (WriteBackLog(num_keys, rank=rank, world_size=world_size,
                            committed=self._port.committed) if writeback else None)
        self._plans = IdExchange(
            rank=rank, world_size=world_size, lookahead=self._window, num_keys=num_keys,
            collective=collective, collectives=collectives, worker=self._worker,
            metrics=self.metrics_, timeout=self._timeout,
            eviction=self.eviction.native() if virtual and self.eviction.tracks else None,
            replicated=writeback,
        )
        self._prefetch = PrefetchScheduler(
            meta=self._meta, port=self._port, metrics=self.metrics_, device=self.device,
            distance=min(config.prepared_batches, self._lookahead),
            prepared_batches=config.prepared_batches, lookahead=self._lookahead,
            adaptive=self._window > self._lookahead,
            with_state=cached and self._dev.state_dim > 0, write_backs=log,
        )
        self._assembler = StepAssembler(
            meta=self._meta, cache=self._dev, prefetch=self._prefetch, port=self._port,
            metrics=self.metrics_, dim=dim, device=self.device, window=self._window,
            collective=collective, write_backs=log,
        )
        self._agg: Aggregation
        if collective:
            kw = dict(
                meta=self._meta, cache=self._dev, cache_lock=self._cache_lock,
                port=self._port, metrics=self.metrics_, collectives=collectives,
                worker=self._worker, window_end=lambda: self._prefetch.fixed_end, rank=rank,
                world_size=world_size, dim=dim, timeout=self._timeout,
            )
            self._agg = (WritebackAggregation(log=log, **kw) if log is not None
                         else CollectiveAggregation(**kw))
        else:
            self._agg = PSAggregation(meta=self._meta, cache=self._dev,
                                      cache_lock=self._cache_lock, port=self._port,
                                      metrics=self.metrics_)
        self._preparer = StepPreparer(
            meta=self._meta, plans=self._plans, prefetch=self._prefetch,
            assembler=self._assembler, aggregation=self._agg, cache_lock=self._cache_lock,
            metrics=self.metrics_, window=self._window, timeout=self._timeout,
            name=f"bagpipe-prep-r{rank}",
        )

    # ---- public API ---------------------------------------------------------------------
    @property
    def capacity_rows(self) -> int:
        return self._meta.capacity_rows if self._meta is not None else 0

    @property
    def fetch_observer(self) -> FetchObserver | None:
        """Test hook: called as (kind, keys, deps, uses, at_step) before each get."""
        return self._port.fetch_observer

    @fetch_observer.setter
    def fetch_observer(self, observer: FetchObserver | None) -> None:
        self._port.fetch_observer = observer

    def prescan(self, local_trace: Sequence[torch.Tensor | np.ndarray], *,
                progress: bool = True) -> None:
        """Plans every step from the whole trace of all ranks before training.

        `local_trace[t]` is this rank's fused keys at step t. One collective (every rank
        calls it with the same number of steps); afterwards each submitted batch is checked
        against the trace (PlanMismatchError naming step and rank).
        REQUIRES: nothing submitted yet.
        """
        self._check_usable()
        if self._submitted or self._plans.prescanned:
            raise ValueError("prescan must be called once, before the first submit")
        t0 = time.perf_counter()
        local = [as_key_array(k, f"prescan trace step {t}") for t, k in enumerate(local_trace)]
        for t, arr in enumerate(local):
            self._check_range(arr, f"prescan trace step {t}")
        self._plans.prescan(local, progress=progress)
        self.metrics_.add(prescan_startup_s=time.perf_counter() - t0)

    def check_submit(self, keys: torch.Tensor | np.ndarray) -> None:
        """Raises what `submit(keys)` would raise for an unusable controller or a bad batch
        (type, range, prescan plan), without submitting anything."""
        self._validated(keys)

    def submit(self, keys: torch.Tensor | np.ndarray) -> None:
        """The next batch's fused keys (1-D int64, CPU) enter the lookahead window."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            s = self._submitted
            arr = self._validated(keys).copy()
            self._plans.submit(s, arr)
            self._local_keys.append(arr)
            self._submitted += 1
            self._launch_ahead()
        finally:
            self.metrics_.add(runtime_critical_s=time.perf_counter() - t0,
                              runtime_critical_cpu_s=time.thread_time() - c0)

    def next_step(self) -> Step:
        """Prepares the oldest submitted batch: its rows, bitwise the PS after the last commit."""
        self._check_usable()
        if self._active is not None:
            raise ValueError(
                f"next_step: step {self._active.step} is still running; call finish_step first"
            )
        t = self._next
        if t >= self._submitted:
            raise ValueError(f"next_step: batch {t} has not been submitted")
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            step = self._prepare(t)
            self._active = step
            self._launch_ahead()
        except BaseException as e:
            self._failed = e
            raise
        finally:
            self.metrics_.add(runtime_critical_s=time.perf_counter() - t0,
                              runtime_critical_cpu_s=time.thread_time() - c0)
        return step

    def finish_step(self, step: Step, grad: torch.Tensor, lr: float | None = None) -> None:
        """Commits the step's row gradient (|U| x dim fp32) at learning rate `lr` (the one in
        force for this step: finite, >= 0; None: the constructor's; Adam: the bias-corrected
        step size) and keeps the cache coherent. Every rank must give a step the same lr."""
        self._check_usable()
        if self._active is None or step is not self._active:
            raise ValueError("finish_step: `step` is not the step returned by next_step")
        if not isinstance(grad, torch.Tensor):
            raise TypeError("finish_step: grad must be a torch.Tensor")
        n = step.unique_keys.numel()
        if grad.dtype != torch.float32:
            raise TypeError(f"finish_step: grad must be float32, got {grad.dtype}")
        if step.rows.shape[0] == n + 1 and tuple(grad.shape) == (n + 1, self.dim):
            grad = grad[:n]  # admission: the zero row's gradient is dropped
        if tuple(grad.shape) != (n, self.dim):
            raise ValueError(
                f"finish_step: grad must have shape ({n}, {self.dim}), got {tuple(grad.shape)}"
            )
        step_lr = self.lr if lr is None else _check_lr(lr, "finish_step: lr")
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._finish(step, grad.detach(), step_lr)
            self._active = None
            self._next += 1
            self._launch_ahead()
        except BaseException as e:
            self._failed = e
            raise
        finally:
            self.metrics_.add(runtime_critical_s=time.perf_counter() - t0,
                              runtime_critical_cpu_s=time.thread_time() - c0)
        self.metrics_.add(steps=1)

    def drain(self) -> None:
        """Waits until the commit of every finished step is committed (bounded by
        ps_timeout); a running step is left running (its commit is not submitted yet), so
        reads outside the step sequence see the PS after the last finished step."""
        self._check_usable()
        try:
            self._drain()
        except BaseException as e:
            self._failed = e
            raise

    def flush(self) -> None:
        """Waits until every submitted commit is committed (bounded by ps_timeout)."""
        self._check_usable()
        if self._active is not None:
            raise ValueError(f"flush: step {self._active.step} is still running")
        try:
            self._drain()
        except BaseException as e:
            self._failed = e
            raise
        if self._preparer.ahead is None:
            # Virtual tables: the last finished step's evictions leave the cache now too.
            self._preparer.drop_evicted()

    def invalidate_all(self) -> None:
        """Forgets every cached and prefetched row (after an external write to the PS)."""
        self._check_usable()
        if self._active is not None:
            raise ValueError(f"invalidate_all: step {self._active.step} is still running")
        self.flush()
        try:
            self._preparer.discard()  # its metadata is cleared: prepared again at next_step
        except BaseException as e:
            self._failed = e
            raise
        with self._cache_lock:
            self._prefetch.clear(self._timeout)
            if self._meta is not None:
                self._meta.clear()
            if isinstance(self._agg, WritebackAggregation):
                self._agg.forget()  # flush() wrote back every row it owned

    def close(self, *, close_ps: bool = True) -> None:
        """Drains pending commits, completes the ID exchanges of batches submitted but never
        run (every rank submitted them, so every rank's worker runs the same collectives:
        no peer is left waiting in one), waits for outstanding gets, closes the PS client.
        A failed controller cancels those exchanges instead; every wait is bounded."""
        if self._closed:
            return
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            if self._failed is None and self._active is None:
                self._drain()
                self._port.committed()
        except BaseException as e:
            error = e
        finally:
            self._closed = True
            failed = self._failed is not None or error is not None
            if failed:
                self._plans.cancel()  # an ahead preparation waiting for them stops at once
            try:
                self._preparer.close()
            except BaseException as e:
                if not failed:  # after a failure, the preparation's error is a consequence
                    error = e
            self._port.mark_closed()
            try:
                with self._cache_lock:
                    self._prefetch.drop_fetches(self._timeout)
            except BaseException as e:
                error = error or e
            if self._failed is None and error is None:
                try:
                    self._plans.complete()
                except BaseException as e:
                    error = e
            self._plans.cancel()
            self._agg.close()
            release_worker(self._coll)
            if close_ps:
                self._port.close_client()
            self.metrics_.add(shutdown_s=time.perf_counter() - t0)
        if error is not None:
            raise error

    def cached_rows(self) -> tuple[np.ndarray, torch.Tensor]:
        """The resident rows: their fused keys and a copy of their cached values, weights
        then optimizer state ([n, dim + state_dim] on the device). For tests and
        inspection, between steps, with no step prepared ahead (whose admitted slots are
        claimed but not yet filled: after the last step, or after `invalidate_all`)."""
        self._check_usable()
        if self._active is not None:
            raise ValueError(f"cached_rows: step {self._active.step} is still running")
        if self._preparer.ahead is not None:
            raise ValueError(f"cached_rows: step {self._preparer.ahead} is prepared ahead")
        if self._meta is None:
            return np.zeros(0, dtype=np.int64), self._dev.gather(np.zeros(0, dtype=np.int64))
        with self._cache_lock:
            keys, slots = [], []
            for i in range(self._meta.capacity_rows):
                key, state, *_ = self._meta.slot(i)
                if state == "ready":
                    keys.append(key)
                    slots.append(i)
            return np.array(keys, dtype=np.int64), self._dev.gather(np.array(slots, np.int64))

    def metrics(self) -> dict[str, float]:
        """The counters (ARCHITECTURE §4.1) as a plain dict; any thread."""
        d = self.metrics_.snapshot()
        d["planner_s"] = self._plans.plan_seconds
        d["plan_memory_bytes"] = self._plans.memory_bytes()
        d["capacity_rows"] = self.capacity_rows
        d["resident_bytes"] = self._dev.resident_bytes
        d["prepared_bytes"] = self._prefetch.prepared_bytes()
        if self._meta is not None:
            with self._cache_lock:
                st = self._meta.stats()
            d["resident_rows"] = st["resident"]
            d["metadata_bytes"] = st["memory_bytes"]
        else:
            d["resident_rows"] = 0
            d["metadata_bytes"] = 0
        d["committed_step"] = self._port.committed()
        if self.eviction is not None:
            # As planned: up to the newest step in the window (ahead of the PS by it).
            d.update(self._plans.eviction_stats())
            d["live_bytes"] = d["live_rows"] * self._row_bytes
        return d

    # ---- the step -----------------------------------------------------------------------
    def _prepare(self, t: int) -> Step:
        work = self._preparer.take(t, self._submitted)
        self._agg.before_step(t)
        batch = self._local_keys.popleft()
        prepared = work.step
        with self._cache_lock:
            rows = self._assembler.assemble(prepared)
        self._finish_plan = work.finish
        plan = prepared.plan
        unique = plan.unique_keys
        inverse = torch.from_numpy(plan.inverse)
        if self._replicated:
            # writeback: the cache read the union's rows; the step is this rank's own rows
            # (first-occurrence order, as under ps), so its backward is theirs bit for bit.
            rows = rows.index_select(0, self._dev.index(plan.own_pos))
            unique = unique[plan.own_pos]
            inverse = torch.from_numpy(plan.own_inverse)
        if inverse.numel() and int(inverse.min()) < 0:
            # Admission: ids not admitted at this step read one zero row after the unique
            # rows (their gradient row is dropped by finish_step).
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
            inverse = torch.where(inverse < 0, unique.size, inverse)
        if self.device.type != "cpu":
            inverse = inverse.to(self.device, non_blocking=True)
        rows.requires_grad_(True)
        return Step(
            step=t,
            keys=torch.from_numpy(batch),
            unique_keys=torch.from_numpy(unique),
            inverse=inverse,
            rows=rows,
            plan=plan,
        )

    def _launch_ahead(self) -> None:
        """Starts preparing the next step not yet prepared, if its window is full (and
        `BagPipeConfig.prepare_ahead`)."""
        if not self.config.prepare_ahead:
            return
        s = self._next + 1 if self._active is not None else self._next
        self._preparer.launch(s, self._submitted)

    def _finish(self, step: Step, grad: torch.Tensor, lr: float) -> None:
        if grad.device != self.device and self._meta is not None:
            grad = grad.to(self.device)
        self._agg.finish(step.step, step.plan, grad, self._finish_plan, lr)
        self._finish_plan = None
        self._preparer.issue_later()

    def _drain(self) -> None:
        t0 = time.perf_counter()
        self._agg.drain()
        self.metrics_.add(commit_wait_s=time.perf_counter() - t0)

    # ---- argument checks ----------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise ControllerError("the BagPipe controller is closed")
        if self._failed is not None:
            raise ControllerError(f"the BagPipe controller failed earlier: {self._failed!r}")

    def _validated(self, keys: torch.Tensor | np.ndarray) -> np.ndarray:
        self._check_usable()
        s = self._submitted
        arr = as_key_array(keys, f"keys of step {s}")
        self._check_range(arr, f"keys of step {s}")
        self._plans.check(s, arr)
        return arr

    def _check_range(self, arr: np.ndarray, what: str) -> None:
        if arr.size == 0 or (arr.min() >= 0 and arr.max() < self.num_keys):
            return
        bad = (arr < 0) | (arr >= self.num_keys)
        pos = int(np.nonzero(bad)[0][0])
        raise ValueError(
            f"{what} (rank {self.rank}): key {int(arr[pos])} at position {pos} is outside "
            f"[0, {self.num_keys})"
        )
