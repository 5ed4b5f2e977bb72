"""BagPipeController: one rank's bounded, coherent, lookahead-prefetched cache of one fused table.

The TorchRec layer drives it (ARCHITECTURE §4)::

    ctl.prescan(local_trace)     # optional, before training (a collective)
    ctl.submit(keys)             # each batch entering the lookahead window (online: a collective)
    step = ctl.next_step()       # oldest submitted batch: unique keys, inverse, rows (|U| x dim)
    ctl.finish_step(step, grad)  # |U| x dim row gradient: commit + keep the cache coherent
    ctl.flush(); ctl.metrics(); ctl.invalidate_all(); ctl.close()

Step order: steps run strictly one after another (next_step(t), finish_step(t),
next_step(t + 1), ...); batch t must have been submitted before next_step(t). Every rank
makes the same sequence of calls (the same number of submits before each next_step): the
window a step sees, and hence every cache decision, is a function of that sequence, so the
cache contents are deterministic. Only *when* a fetch is issued depends on commit timing.

Coherence (PS-owned BagPipe; invariants in docs/ARCHITECTURE.md §1). A resident row carries a
version: the step whose commit its values reflect (-1: initial). Step t reads row k at version
dep(k, t), the last global step < t that touched k.
  * ps aggregation: after step t a rank updates the resident rows only it touched with its own
    gradient (u = g / W, u = u * lr, w = w - u: bitwise the PS's result) and sets their version
    to t; resident rows another rank touched are invalidated (it knows them from the exchanged
    ids). The rank commits its unique-row gradients to the PS.
  * collective aggregation: the step's gradients are all-reduced over the global union of keys
    (every rank knows it), rows the next step reads (S_now) first and synchronously, the rest
    (S_later) on the communication worker, overlapping the next forward; every rank updates all
    of its resident affected rows; the row's designated rank (union index mod W) submits it.
  * Prefetch: when a step enters the window its keys become candidates. A candidate (k, u) is
    placed once the rank has finished step dep(k, u) (its own invalidations are done) and at
    most `prepared_batches` steps before u. If k is then not resident at version dep(k, u),
    its get is issued as soon as ``committed_step() >= dep(k, u)`` (checked at issue time:
    invariant 4) and the row waits in the device cache's bounded prepared-batch queue; one
    whose dependency has not committed by step u is fetched on demand.
  * Eviction (oracle): at step t the misses are admitted soonest-next-use first, evicting the
    resident row whose next use in the window is furthest or absent, and bypassing the cache
    when no resident row is needed later than the candidate: Belady's MIN with bypass over
    the lookahead window (rows another rank will update before our next read count as
    absent). Prefetched rows enter the cache only through this admission, so prefetching
    changes when rows are fetched, never what is cached.
  * A forward waits for a commit only through a fetch whose dependency is that commit; each
    commit is submitted only after its predecessor committed.

Threading: call the controller from one thread. It runs collectives and commit submissions
on a worker thread per `Collectives` instance (shared by the controllers of one rank, FIFO),
so the `Collectives` instance must not be used by anything else while controllers are open.
PS client calls are serialized by a lock; handles are waited outside it. Online, each
submitted batch's ID exchange and its planning (`add_step`) run as one worker task, so the
training thread only waits for a plan it needs; the planner is guarded by its own lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.config import ROWS_PER_CACHE_UNIT, BagPipeConfig
from torchrec_bagpipe.runtime.collectives import Collectives
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.planner import (
    OnlinePlanner,
    PrescanPlanner,
    StepPlan,
    as_key_array,
)
from torchrec_bagpipe.runtime.worker import acquire_worker, release_worker

__all__ = ["BagPipeController", "ControllerError", "Handle", "PSClientLike", "Step"]


class Handle(Protocol):
    def wait(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


class PSClientLike(Protocol):
    dim: int

    def get_async(self, keys: torch.Tensor, at_step: int) -> Handle: ...

    def commit_async(self, step: int, keys: torch.Tensor, grads: torch.Tensor) -> Handle: ...

    def committed_step(self) -> int: ...

    def close(self) -> None: ...


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


@dataclass
class _Fetch:
    """One issued prefetch get. Its rows stay in its own buffer until their steps read them
    (moved to the device once, by `_materialize`)."""

    handle: Handle
    keys: np.ndarray
    uses: np.ndarray   # use step of each key
    upos: np.ndarray   # index of each key in its use step's unique keys
    min_use: int
    max_use: int
    rows: torch.Tensor | None = None  # on the device, once materialized


@dataclass
class _NowUpdate:
    """Collective aggregation: the S_now all-reduce of one step, applied to the resident
    rows before the next step reads them."""

    future: Future
    grads: torch.Tensor   # reduced in place by the worker
    slots: np.ndarray     # resident slots of S_now rows
    rows: torch.Tensor    # their rows in `grads`


_Group = tuple[np.ndarray, np.ndarray, np.ndarray, int]


def _i64(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


_EMPTY = np.zeros(0, dtype=np.int64)
_INT32_KEYS = (1 << 31) - 1  # fused keys below this travel as int32 in ID exchanges


class BagPipeController:
    """One rank's BagPipe runtime for one fused table (see the module docstring)."""

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
        if not (isinstance(lr, (int, float)) and np.isfinite(lr)):
            raise ValueError(f"lr must be a finite number, got {lr!r}")
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
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.dim = dim
        self.num_keys = num_keys
        self.lr = float(lr)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._ps = ps
        self._coll = collectives
        self._timeout = float(config.ps_timeout)
        self._collective = config.bagpipe_aggregation == "collective"
        self._cached = config.read_mode == "bagpipe"
        self._lookahead = config.lookahead if self._cached else 0
        self._distance = min(config.prepared_batches, self._lookahead)
        self._divide = config.resolved_gradient_division()
        self.metrics_ = RuntimeMetrics()

        if self._cached:
            rows = config.cache_rows(num_keys)
            self._meta = C.BagPipeCacheMetadata(rows // ROWS_PER_CACHE_UNIT, config.eviction_policy)
            self._dev = DeviceCache(
                self._meta.capacity_rows,
                dim,
                self.device,
                lr=self.lr,
                world_size=world_size,
                divide=self._divide,
            )
        else:
            self._meta = None
            self._dev = DeviceCache(0, dim, self.device, lr=self.lr, world_size=world_size,
                                    divide=self._divide)
        planner_kw = dict(
            world_size=world_size,
            rank=rank,
            lookahead=self._lookahead,
            num_keys=num_keys,
            collective=self._collective,
        )
        self._online = OnlinePlanner(**planner_kw)
        self._prescan: PrescanPlanner | None = None
        self._planner_kw = planner_kw

        self._lock = threading.RLock()      # metadata + device values (caller vs worker)
        self._ps_lock = threading.Lock()    # serializes PS client calls
        self._worker = acquire_worker(collectives)
        self._failed: BaseException | None = None
        self._closed = False

        self._submitted = 0
        self._next = 0
        self._active: Step | None = None
        self._local_keys: deque[np.ndarray] = deque()          # submitted, not yet run
        # Online: (step, future of its exchange + add_step on the worker), not yet awaited.
        self._exchanges: deque[tuple[int, Future]] = deque()
        # Guards the online planner: the worker adds steps while this thread reads plans.
        self._plan_lock = threading.Lock()
        self._exchange_dtype = np.int32 if num_keys <= _INT32_KEYS else np.int64
        self._entered = -1                                     # last step in the window
        # Prefetch candidates (keys, deps, upos: index in the use step's unique keys, use).
        self._ready: list[_Group] = []                         # to place at the next step
        self._deferred: dict[int, list[_Group]] = {}           # by placement step
        self._pend: dict[int, list[_Group]] = {}               # placed, not issued; by use
        self._fetches: dict[int, _Fetch] = {}
        self._next_fid = 0
        self._staged_fids: dict[int, list[int]] = {}  # use step -> fetches holding its rows
        self._tasks: deque[tuple[int, Future]] = deque()        # worker tasks (collective)
        self._commits: deque[Handle] = deque()                  # commits not known done
        self._last_commit: Handle | None = None
        self._later_pins: dict[int, Future] = {}  # collective: step -> its S_later task
        self._now_update: _NowUpdate | None = None  # collective: the last step's S_now
        self._last_committed = -1
        # Test hook: called as (kind, keys, deps, uses, at_step) before each get.
        self.fetch_observer: Callable[[str, np.ndarray, np.ndarray, np.ndarray, int], None] | None
        self.fetch_observer = None

    # ---- public API ---------------------------------------------------------------------
    @property
    def capacity_rows(self) -> int:
        return self._meta.capacity_rows if self._meta is not None else 0

    def prescan(self, local_trace: Sequence[torch.Tensor | np.ndarray], *,
                progress: bool = True) -> None:
        """Plans every step from the whole trace of all ranks before training.

        `local_trace[t]` is this rank's fused keys at step t. One collective (every rank
        calls it with the same number of steps); afterwards each submitted batch is checked
        against the trace (PlanMismatchError naming step and rank).
        REQUIRES: nothing submitted yet.
        """
        self._check_usable()
        if self._submitted or self._prescan is not None:
            raise ValueError("prescan must be called once, before the first submit")
        t0 = time.perf_counter()
        local = [as_key_array(k, f"prescan trace step {t}") for t, k in enumerate(local_trace)]
        for t, arr in enumerate(local):
            self._check_range(arr, f"prescan trace step {t}")
        lens = np.array([len(local)] + [a.size for a in local], dtype=np.int64)
        packed = torch.from_numpy(np.concatenate([lens, *local]) if local else lens)
        parts = self._collect(self._coll.all_gather, packed)
        self.metrics_.add(id_exchange_bytes=packed.numel() * 8, collectives_issued=1)
        per_rank: list[list[np.ndarray]] = []
        steps = len(local)
        for q, part in enumerate(parts):
            arr = part.numpy()
            n = int(arr[0])
            if n != steps:
                raise ValueError(
                    f"prescan: rank {q} has {n} steps in its trace, rank {self.rank} has {steps}"
                )
            sizes = arr[1 : 1 + n]
            bounds = np.concatenate([[0], np.cumsum(sizes)]) + 1 + n
            per_rank.append([arr[bounds[t] : bounds[t + 1]] for t in range(n)])
        trace = [[per_rank[q][t] for q in range(self.world_size)] for t in range(steps)]
        planner = PrescanPlanner(**self._planner_kw)
        planner.build(trace, progress=progress)
        self._prescan = planner
        self.metrics_.add(prescan_startup_s=time.perf_counter() - t0)

    def submit(self, keys: torch.Tensor | np.ndarray) -> None:
        """The next batch's fused keys (1-D int64, CPU) enter the lookahead window."""
        self._check_usable()
        s = self._submitted
        arr = as_key_array(keys, f"keys of step {s}")
        self._check_range(arr, f"keys of step {s}")
        arr = arr.copy()
        if self._prescan is not None:
            self._prescan.check(s, arr)
        else:
            # The exchange and the planning of this batch run on the worker, off the training
            # thread; `_absorb` waits for them (bounded) when a step needs the plan.
            fut = self._worker.submit(self._exchange_and_plan, s, arr)
            self._exchanges.append((s, fut))
        self._local_keys.append(arr)
        self._submitted += 1

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
        try:
            step = self._prepare(t)
        except BaseException as e:
            self._failed = e
            raise
        self._active = step
        return step

    def finish_step(self, step: Step, grad: torch.Tensor) -> None:
        """Commits the step's row gradient (|U| x dim fp32) and keeps the cache coherent."""
        self._check_usable()
        if self._active is None or step is not self._active:
            raise ValueError("finish_step: `step` is not the step returned by next_step")
        if not isinstance(grad, torch.Tensor):
            raise TypeError("finish_step: grad must be a torch.Tensor")
        n = step.plan.unique_keys.size
        if grad.dtype != torch.float32:
            raise TypeError(f"finish_step: grad must be float32, got {grad.dtype}")
        if tuple(grad.shape) != (n, self.dim):
            raise ValueError(
                f"finish_step: grad must have shape ({n}, {self.dim}), got {tuple(grad.shape)}"
            )
        try:
            self._finish(step, grad.detach())
        except BaseException as e:
            self._failed = e
            raise
        self._active = None
        self._next += 1
        self.metrics_.add(steps=1)

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

    def invalidate_all(self) -> None:
        """Forgets every cached and prefetched row (after an external write to the PS)."""
        self._check_usable()
        if self._active is not None:
            raise ValueError(f"invalidate_all: step {self._active.step} is still running")
        self.flush()
        with self._lock:
            self._drop_fetches()
            if self._meta is not None:
                self._meta.clear()
            self._ready = []
            self._deferred.clear()
            self._pend.clear()

    def close(self, *, close_ps: bool = True) -> None:
        """Drains pending commits, waits for outstanding gets, closes the PS client."""
        if self._closed:
            return
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            if self._failed is None and self._active is None:
                self._drain()
                self._committed()
        except BaseException as e:
            error = e
        finally:
            self._closed = True
            try:
                with self._lock:
                    self._drop_fetches()
            except BaseException as e:
                error = error or e
            futures = [x[1] for x in self._exchanges] + [f for _, f in self._tasks]
            if self._now_update is not None:
                futures.append(self._now_update.future)
            for fut in futures:
                fut.cancel()
            release_worker(self._coll)
            if close_ps:
                with self._ps_lock:
                    self._ps.close()
            self.metrics_.add(shutdown_s=time.perf_counter() - t0)
        if error is not None:
            raise error

    def metrics(self) -> dict[str, float]:
        d = self.metrics_.snapshot()
        d["planner_s"] = self._online.plan_seconds + (
            self._prescan.plan_seconds if self._prescan is not None else 0.0
        )
        if self._prescan is not None:
            d["plan_memory_bytes"] = self._prescan.memory_bytes()
        else:
            with self._plan_lock:
                d["plan_memory_bytes"] = self._online.memory_bytes()
        d["capacity_rows"] = self.capacity_rows
        d["resident_bytes"] = self._dev.resident_bytes
        d["prepared_bytes"] = sum(
            f.rows.numel() * f.rows.element_size()
            for f in list(self._fetches.values()) if f.rows is not None
        )
        if self._meta is not None:
            with self._lock:
                st = self._meta.stats()
            d["resident_rows"] = st["resident"]
            d["metadata_bytes"] = st["memory_bytes"]
        else:
            d["resident_rows"] = 0
            d["metadata_bytes"] = 0
        d["committed_step"] = self._committed()
        return d

    snapshot = metrics  # the metrics as a plain dict, under the name the runtime API documents

    # ---- helpers ------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise ControllerError("the BagPipe controller is closed")
        if self._failed is not None:
            raise ControllerError(f"the BagPipe controller failed earlier: {self._failed!r}")

    def _check_range(self, arr: np.ndarray, what: str) -> None:
        if arr.size == 0 or (arr.min() >= 0 and arr.max() < self.num_keys):
            return
        bad = (arr < 0) | (arr >= self.num_keys)
        pos = int(np.nonzero(bad)[0][0])
        raise ValueError(
            f"{what} (rank {self.rank}): key {int(arr[pos])} at position {pos} is outside "
            f"[0, {self.num_keys})"
        )

    def _collect(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs a collective on the worker and waits for it (bounded)."""
        t0 = time.perf_counter()
        try:
            return self._worker.submit(fn, *args).result(timeout=self._timeout)
        finally:
            self.metrics_.add(collective_wait_s=time.perf_counter() - t0)

    def _index(self, positions: np.ndarray) -> torch.Tensor:
        """int64 positions as an index tensor on the device."""
        t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _committed(self) -> int:
        if self._closed:
            return self._last_committed
        with self._ps_lock:
            self._last_committed = int(self._ps.committed_step())
        return self._last_committed

    def _get(self, kind: str, keys: np.ndarray, deps: np.ndarray, uses: np.ndarray,
             out: torch.Tensor | None = None) -> Handle:
        """Issues one get at the largest dependency step (the rows land in `out` if given)."""
        at_step = int(deps.max()) if deps.size else -1
        if self.fetch_observer is not None:
            self.fetch_observer(kind, keys, deps, uses, at_step)
        with self._ps_lock:
            if out is None:
                return self._ps.get_async(torch.from_numpy(keys), at_step)
            return self._ps.get_async(torch.from_numpy(keys), at_step, out=out)

    def _wait_rows(self, handle: Handle, n: int) -> torch.Tensor:
        rows = handle.wait(self._timeout)
        if not isinstance(rows, torch.Tensor):
            rows = torch.as_tensor(np.asarray(rows))
        if rows.dtype != torch.float32 or tuple(rows.shape) != (n, self.dim):
            raise ValueError(
                f"the PS returned rows of shape {tuple(rows.shape)} {rows.dtype}, expected "
                f"({n}, {self.dim}) float32"
            )
        self.metrics_.add(fetched_bytes=n * self.dim * 4)
        return rows

    def _poll_tasks(self) -> None:
        """Raises the error of a failed commit or worker task; forgets finished ones."""
        while self._tasks and self._tasks[0][1].done():
            _, fut = self._tasks.popleft()
            fut.result()
        while self._commits and self._commits[0].done():
            self._commits.popleft().wait(self._timeout)  # raises a failed commit's error

    def _drain(self) -> None:
        t0 = time.perf_counter()
        self._apply_now_update()
        while self._tasks:
            _, fut = self._tasks[0]
            fut.result(timeout=self._timeout)
            self._tasks.popleft()
        self._later_pins.clear()
        while self._commits:
            self._commits[0].wait(self._timeout)
            self._commits.popleft()
        self.metrics_.add(commit_wait_s=time.perf_counter() - t0)

    def _drop_fetches(self) -> None:
        """Waits for every outstanding prefetch and forgets it (REQUIRES: self._lock)."""
        errors = []
        for f in self._fetches.values():
            if f.rows is None:
                try:
                    f.handle.wait(self._timeout)
                except BaseException as e:  # keep draining the rest
                    errors.append(e)
        self._fetches.clear()
        self._staged_fids.clear()
        if errors:
            raise errors[0]

    # ---- planning ---------------------------------------------------------------------
    def _plan(self, s: int) -> StepPlan:
        if self._prescan is not None:
            return self._prescan.plan(s)
        with self._plan_lock:
            return self._online.plan(s)

    def _exchange_and_plan(self, s: int, own: np.ndarray) -> None:
        """Runs on the worker (FIFO, so steps are added in order): exchanges batch s with
        every rank and adds it to the online planner.

        The other ranks' planners need this batch's distinct keys only (first-occurrence
        order keeps every rank's plans identical to prescan's) and its id count; int32 when
        the fused keys fit. A plan read by the training thread is a copy, and the fields the
        controller uses do not depend on steps added past its window (next_use beyond the
        entered steps is masked in `_prepare_cached`), so adding steps early changes no
        decision.
        """
        unique = C.unique_keys(own)
        msg = np.empty(unique.size + 1, dtype=self._exchange_dtype)
        msg[0] = own.size
        msg[1:] = unique
        self.metrics_.add(id_exchange_bytes=msg.nbytes, collectives_issued=1)
        parts = self._coll.all_gather(torch.from_numpy(msg))
        per_rank: list[np.ndarray] = []
        global_ids = 0
        for q, part in enumerate(parts):
            m = part.numpy()
            if m.size < 1:
                raise RuntimeError(f"ID exchange of step {s}: rank {q} sent no header")
            global_ids += int(m[0])
            per_rank.append(own if q == self.rank else m[1:].astype(np.int64))
        with self._plan_lock:
            added = self._online.add_step(per_rank, global_ids=global_ids)
        if added != s:
            raise RuntimeError(f"planner out of step: added {added}, expected {s}")

    def _absorb(self, upto: int) -> None:
        """Online: waits until every batch with step <= upto is exchanged and planned."""
        while self._exchanges and self._exchanges[0][0] <= upto:
            _, fut = self._exchanges[0]
            t0 = time.perf_counter()
            fut.result(timeout=self._timeout)
            self.metrics_.add(collective_wait_s=time.perf_counter() - t0)
            self._exchanges.popleft()

    def _enter_window(self, t: int) -> None:
        """Steps up to t + lookahead that were submitted enter the window (REQUIRES: lock)."""
        last = min(t + self._lookahead, self._submitted - 1)
        for s in range(self._entered + 1, last + 1):
            self._entered = s
            if s <= t or self._meta is None:
                continue
            p = self._plan(s)
            noted = (p.prev_use >= 0) & (p.prev_use < t)
            if noted.any():
                self._meta.note_uses(p.unique_keys[noted], s)
            # A candidate is placed at step max(dep + 1, s - distance): once this rank has
            # finished its dependency, and at most `distance` steps before its use.
            when = np.maximum(p.deps + 1, s - self._distance)
            if when.size == 0:
                continue
            lo = int(when.min())
            if lo == int(when.max()):
                groups: list[tuple[int, np.ndarray | None]] = [(lo, None)]
            else:
                groups = [(int(w), when == w) for w in np.unique(when)]
            for w, m in groups:
                if m is None:
                    upos = np.arange(p.unique_keys.size, dtype=np.int64)
                    group = (p.unique_keys, p.deps, upos, s)
                else:
                    upos = np.flatnonzero(m)
                    group = (p.unique_keys[upos], p.deps[upos], upos, s)
                if w <= t:
                    self._ready.append(group)
                else:
                    self._deferred.setdefault(w, []).append(group)

    def _place_candidates(self, t: int) -> None:
        """Queues prefetches for candidates placed at step t (REQUIRES: lock)."""
        groups = self._deferred.pop(t, [])
        if self._ready:
            groups = self._ready + groups
            self._ready = []
        for keys, deps, upos, use in groups:
            if use <= t:  # the step's own keys are misses, fetched on demand
                continue
            # Rows resident at the wanted version are expected hits; the rest are prefetched.
            need = self._meta.resident(keys, deps) < 0
            if need.all():
                self._pend.setdefault(use, []).append((keys, deps, upos, use))
            elif need.any():
                self._pend.setdefault(use, []).append((keys[need], deps[need], upos[need], use))

    def _issue_ready(self) -> None:
        """Issues one get for every queued prefetch whose dependency has committed."""
        if not self._pend:
            return
        committed = self._committed()
        take: list[_Group] = []
        for use in list(self._pend):
            groups = self._pend[use]
            stay: list[_Group] = []
            for g in groups:
                deps = g[1]
                if deps.size == 0:
                    continue
                if int(deps.max()) <= committed:
                    take.append(g)
                    continue
                go = deps <= committed
                if go.any():
                    take.append((g[0][go], deps[go], g[2][go], use))
                    stay.append((g[0][~go], deps[~go], g[2][~go], use))
                else:
                    stay.append(g)
            if stay:
                self._pend[use] = stay
            else:
                del self._pend[use]
        if not take:
            return
        if len(take) == 1:
            k, d, up, use = take[0]
            u = np.full(k.size, use, dtype=np.int64)
            uses_list = [use]
        else:
            k = np.concatenate([g[0] for g in take])
            d = np.concatenate([g[1] for g in take])
            up = np.concatenate([g[2] for g in take])
            u = np.concatenate([np.full(g[0].size, g[3], dtype=np.int64) for g in take])
            uses_list = sorted({g[3] for g in take})
        k = _i64(k)
        handle = self._get("prefetch", k, d, u)
        fid = self._next_fid
        self._next_fid += 1
        self._fetches[fid] = _Fetch(handle, k, u, up, uses_list[0], uses_list[-1])
        for use in uses_list:
            self._staged_fids.setdefault(use, []).append(fid)
        self.metrics_.add(prefetched=int(k.size), prefetch_gets=1)

    def _materialize(self, f: _Fetch) -> torch.Tensor:
        """Waits for a prefetch and moves its rows to the device (once)."""
        if f.rows is None:
            t0 = time.perf_counter()
            rows = self._wait_rows(f.handle, f.keys.size)
            self.metrics_.add(fetch_wait_s=time.perf_counter() - t0,
                              staged_rows=int(f.keys.size))
            f.rows = rows if self.device.type == "cpu" else rows.to(self.device,
                                                                    non_blocking=True)
        return f.rows

    def _materialize_ready(self, t: int) -> None:
        """Moves finished prefetches for the next prepared_batches steps to the device."""
        horizon = t + self.config.prepared_batches
        for f in list(self._fetches.values()):
            if f.rows is None and f.min_use <= horizon and f.handle.done():
                self._materialize(f)

    # ---- the step ---------------------------------------------------------------------
    def _prepare(self, t: int) -> Step:
        self._poll_tasks()
        self._apply_now_update()
        upto = min(t + self._lookahead, self._submitted - 1)
        if self._prescan is None:
            self._absorb(upto)
            with self._plan_lock:
                self._online.release(t)
        # Collective: S_later updates of steps <= t - 2 must land before their pins expire.
        for s in [s for s in self._later_pins if s <= t - 2]:
            self._later_pins.pop(s).result(timeout=self._timeout)
        batch = self._local_keys.popleft()
        if self._meta is None:
            self._entered = max(self._entered, upto)
            plan = self._plan(t)
            return self._prepare_uncached(t, batch, plan)
        with self._lock:
            self._meta.advance(t)
            self._enter_window(t)
            plan = self._plan(t)
            return self._prepare_cached(t, batch, plan)

    def _record_dependency(self, t: int, demand_deps: np.ndarray) -> None:
        if t == 0:
            return
        if self._committed() < t - 1:
            if demand_deps.size and int(demand_deps.max()) >= t - 1:
                self.metrics_.add(dependency_waits=1)
            else:
                self.metrics_.add(skipped_dependency_waits=1)

    def _make_step(self, t: int, batch: np.ndarray, plan: StepPlan, rows: torch.Tensor) -> Step:
        inverse = torch.from_numpy(plan.inverse)
        if self.device.type != "cpu":
            inverse = inverse.to(self.device, non_blocking=True)
        rows.requires_grad_(True)
        return Step(
            step=t,
            keys=torch.from_numpy(batch),
            unique_keys=torch.from_numpy(plan.unique_keys),
            inverse=inverse,
            rows=rows,
            plan=plan,
        )

    def _demand(self, t: int, keys: np.ndarray, deps: np.ndarray,
                out: torch.Tensor) -> Handle | None:
        """Issues the demand get of step t; on the CPU the rows land in `out` directly."""
        if not keys.size:
            return None
        uses = np.full(keys.size, t, dtype=np.int64)
        if self.device.type == "cpu":
            return self._get("demand", keys, deps, uses, out=out)
        return self._get("demand", keys, deps, uses)

    def _finish_demand(self, handle: Handle | None, n: int, out: torch.Tensor) -> None:
        """Waits for the demand rows and puts them in `out` (where a CPU get wrote them)."""
        if handle is None:
            return
        t0 = time.perf_counter()
        rows = self._wait_rows(handle, n)
        self.metrics_.add(fetch_wait_s=time.perf_counter() - t0)
        if rows.data_ptr() != out.data_ptr():
            out.copy_(rows, non_blocking=True)

    def _prepare_uncached(self, t: int, batch: np.ndarray, plan: StepPlan) -> Step:
        n = plan.unique_keys.size
        self._record_dependency(t, plan.deps)
        rows = torch.empty(n, self.dim, dtype=torch.float32, device=self.device)
        handle = self._demand(t, plan.unique_keys, plan.deps, rows)
        self._finish_demand(handle, n, rows)
        self.metrics_.add(accesses=n, demand_fetched=n, demand_gets=int(n > 0))
        return self._make_step(t, batch, plan, rows)

    def _prepare_cached(self, t: int, batch: np.ndarray, plan: StepPlan) -> Step:
        """The step's rows: hits from the cache, prefetched rows, demand gets; then the
        misses are admitted (Belady over the window) and the next prefetches issued.

        The rows are gathered, never scattered, into one staging tensor laid out as
        [hits | prefetched | demand] (the demand get writes its part directly on the CPU),
        then permuted into unique-key order with one gather.
        """
        meta, dev = self._meta, self._dev
        U, deps = plan.unique_keys, plan.deps
        n = U.size
        next_use = plan.next_use
        if self._entered < t + self._lookahead and next_use.size:
            next_use = np.where(next_use <= self._entered, next_use, -1)
        hit_pos, hit_slots, miss_pos, stale = meta.query(U, deps, next_use)
        nh = hit_pos.size
        # Prefetches of this step still queued (dependency not committed) become demand.
        self._pend.pop(t, None)
        # Prefetched rows of this step: (fetch rows, rows in the fetch, positions in U).
        missing = np.zeros(n, dtype=bool)
        missing[miss_pos] = True
        queued: list[tuple[torch.Tensor, np.ndarray, np.ndarray]] = []
        nq = 0
        for fid in self._staged_fids.pop(t, ()):
            f = self._fetches[fid]
            sel = np.flatnonzero(f.uses == t)
            upos = f.upos[sel]
            use = missing[upos]
            if not use.all():
                sel, upos = sel[use], upos[use]
            if upos.size:
                queued.append((self._materialize(f), sel, upos))
                missing[upos] = False
                nq += upos.size
        d_pos = np.flatnonzero(missing) if nq else miss_pos
        d_keys = U[d_pos]
        d_deps = deps[d_pos]
        self._record_dependency(t, d_deps)
        src = torch.empty(n, self.dim, dtype=torch.float32, device=self.device)
        handle = self._demand(t, d_keys, d_deps, src[nh + nq:])
        # Admission, soonest next use first (none last): admitted rows are pinned for the
        # step, so the rows worth keeping claim slots before the ones worth less (Belady).
        a_pos = a_slots = _EMPTY
        # ps aggregation: a row another rank touches at this step is invalidated right after
        # it (its update is not known here), so it is served without taking a slot.
        cand = miss_pos if self._collective else miss_pos[~plan.shared[miss_pos]]
        if cand.size:
            miss_nu = next_use[cand]
            horizon = self._lookahead + 1
            rank = np.where(miss_nu < 0, horizon, miss_nu - t)
            rank = rank.astype(np.int16 if horizon < (1 << 15) else np.int64)
            order = np.argsort(rank, kind="stable")
            mp = cand[order]
            a_idx, a_slots, evicted, a_bypassed = meta.admit(U[mp], deps[mp], miss_nu[order])
            a_pos = mp[a_idx]
            self.metrics_.add(evictions=int(evicted.size), bypassed=int(a_bypassed.size))
        if stale:
            self.metrics_.add(stale=int(stale))
        self._place_candidates(t)
        self._issue_ready()
        # Assemble: [hits | prefetched | demand], then one gather into unique-key order.
        order_src = np.empty(n, dtype=np.int64)
        if nh:
            torch.index_select(dev.values, 0, self._index(hit_slots), out=src[:nh])
            order_src[hit_pos] = np.arange(nh)
        off = nh
        for rows_f, sel, upos in queued:
            k = upos.size
            torch.index_select(rows_f, 0, self._index(sel), out=src[off:off + k])
            order_src[upos] = np.arange(off, off + k)
            off += k
        if d_pos.size:
            order_src[d_pos] = np.arange(off, n)
        self._finish_demand(handle, d_pos.size, src[off:])
        rows = src if nh == n else src.index_select(0, self._index(order_src))
        if a_slots.size:
            dev.fill(a_slots, rows.index_select(0, self._index(a_pos)))
        for fid in [fid for fid, f in self._fetches.items() if f.max_use <= t]:
            f = self._fetches.pop(fid)
            if f.rows is None:  # not read (its rows became hits): still drain the get
                self._materialize(f)
        self._materialize_ready(t)
        self.metrics_.add(
            accesses=n,
            hits=nh,
            prefetch_served=nq,
            demand_fetched=int(d_pos.size),
            demand_gets=int(d_pos.size > 0),
        )
        return self._make_step(t, batch, plan, rows)

    # ---- after the backward -------------------------------------------------------------
    def _finish(self, step: Step, grad: torch.Tensor) -> None:
        t = step.step
        plan = step.plan
        U = plan.unique_keys
        if grad.device != self.device and self._meta is not None:
            grad = grad.to(self.device)
        if self._collective:
            self._finish_collective(step, grad)
            return
        if self._meta is not None:
            with self._lock:
                local = np.flatnonzero(~plan.shared)
                if local.size:
                    slots = self._meta.lookup(U[local] if local.size != U.size else U)
                    have = slots >= 0
                    if not have.all():
                        local, slots = local[have], slots[have]
                    if slots.size:
                        self._dev.sgd_(slots, grad.index_select(0, self._index(local)))
                        self._meta.set_version(slots, t)
                    self.metrics_.add(local_updates=int(slots.size))
                if plan.others.size:
                    freed = self._meta.invalidate(plan.others)
                    self.metrics_.add(invalidations=int(freed.size))
        # A private copy: the caller may reuse its gradient buffer before the commit runs.
        grads_cpu = grad.detach().to("cpu", copy=True)
        self._commit(t, torch.from_numpy(U), grads_cpu)
        self._issue_ready_locked()

    def _commit(self, t: int, keys: torch.Tensor, grads: torch.Tensor) -> None:
        """Submits step t's commit. The client starts it once its previous commit completed
        (ARCHITECTURE §3, client rules), so nobody waits here."""
        with self._ps_lock:
            handle = self._ps.commit_async(t, keys, grads)
        self._last_commit = handle
        self._commits.append(handle)
        self.metrics_.add(gradient_payload_bytes=keys.numel() * 8 + grads.numel() * 4)

    def _finish_collective(self, step: Step, grad: torch.Tensor) -> None:
        """Collective aggregation: the step's gradients over the global union of keys are
        all-reduced on the worker: S_now (rows step t + 1 reads) first, applied to the
        resident rows at the start of the next step; S_later with the commit, overlapping
        the next forward. The union row's designated rank (index mod W) commits it."""
        t = step.step
        plan = step.plan
        union = plan.union_keys
        nu = union.size
        s_now = plan.s_now if self._entered >= t + 1 else np.ones(nu, dtype=bool)
        now_idx = np.flatnonzero(s_now)
        later_idx = np.flatnonzero(~s_now)
        dev = grad.device
        # Each union row's gradient row (or the zero row past the end): one gather each.
        padded = torch.cat([grad, torch.zeros(1, self.dim, dtype=grad.dtype, device=dev)])
        src_of = np.full(nu, plan.unique_keys.size, dtype=np.int64)
        src_of[plan.union_pos] = np.arange(plan.union_pos.size)

        def dense(idx: np.ndarray) -> torch.Tensor:
            return padded.index_select(0, torch.from_numpy(src_of[idx]).to(dev))

        g_now = dense(now_idx)
        g_later = dense(later_idx)
        later_slots = later_sel = _EMPTY
        now_slots = now_rows = _EMPTY
        if self._meta is not None:
            with self._lock:
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
                self.metrics_.add(local_updates=int(now_slots.size + later_slots.size))
        if now_idx.size:
            fut = self._worker.submit(self._coll.all_reduce_sum_, g_now)
            self.metrics_.add(allreduce_payload_bytes=g_now.numel() * 4, collectives_issued=1)
            self._now_update = _NowUpdate(fut, g_now, now_slots,
                                          torch.from_numpy(now_rows).to(dev))
        designated = (np.arange(nu) % self.world_size) == self.rank
        d_now = np.flatnonzero(designated[now_idx])
        d_later = np.flatnonzero(designated[later_idx])
        keys_t = torch.from_numpy(
            np.concatenate([union[now_idx][d_now], union[later_idx][d_later]]))

        def later_part() -> torch.Tensor:
            # Runs on the worker after the S_now all-reduce (FIFO), so g_now is reduced.
            if later_idx.size:
                self._coll.all_reduce_sum_(g_later)
                self.metrics_.add(allreduce_payload_bytes=g_later.numel() * 4,
                                  collectives_issued=1)
                if later_slots.size:
                    # No lock: these slots are pinned through t + 1 and nobody else touches
                    # them until next_step(t + 2) joins this task.
                    sel = torch.from_numpy(later_sel).to(dev)
                    self._dev.sgd_(later_slots, g_later.index_select(0, sel))
            parts = [g_now.index_select(0, torch.from_numpy(d_now).to(dev)),
                     g_later.index_select(0, torch.from_numpy(d_later).to(dev))]
            return torch.cat(parts).cpu()

        fut = self._worker.submit(self._commit_task, t, keys_t, later_part)
        self._tasks.append((t, fut))
        if later_slots.size:
            self._later_pins[t] = fut
        self._issue_ready_locked()

    def _apply_now_update(self) -> None:
        """Collective: waits for the last step's S_now all-reduce and applies it to the
        resident rows (before anything reads them)."""
        upd = self._now_update
        if upd is None:
            return
        self._now_update = None
        t0 = time.perf_counter()
        upd.future.result(timeout=self._timeout)
        self.metrics_.add(collective_wait_s=time.perf_counter() - t0)
        if upd.slots.size:
            with self._lock:
                self._dev.sgd_(upd.slots, upd.grads.index_select(0, upd.rows))

    def _issue_ready_locked(self) -> None:
        if self._meta is None:
            return
        with self._lock:
            self._issue_ready()

    def _commit_task(self, t: int, keys: torch.Tensor,
                     produce: Callable[[], torch.Tensor]) -> None:
        """Runs on the worker (collective aggregation): the S_later reduce, then commit t."""
        grads = produce()
        self._commit(t, keys, grads)
