"""PrefetchScheduler: which rows to fetch ahead of their step, when, and where they wait.

The lookahead window holds the submitted steps up to t + lookahead; `enter_window` takes each
new step's plan in (`entered` is the last step in it). With an adaptive window
(`BagPipeConfig.lookahead_max`, `adaptive` here) it then takes further submitted steps in,
up to t + lookahead_max, while the cache is under pressure (step t's reads do not fit beside
the resident rows) and the steps ahead would tell it something new (`_informs`: a read of a
row it holds with no known next use). Entering a step later than every known next use
changes exactly those rows' ranks (kNever -> that step), so a step that informs nothing
cannot change a decision yet. The probe looks `lookahead` steps past the last informative
one (one uninformative step is noise, `lookahead` of them the end of the reuses the cache
can use) and the window grows through the last informative step it found; it thus reaches
about as far as the rows the cache holds are reused (docs/adaptive_lookahead.md). A step
once in stays in, and the probe reads only the plans and the metadata, so every decision
stays deterministic.

Each entering step s > t yields candidates: its keys with their dependency steps, placed at
step max(dep + 1, s - distance) (`distance` = prepared_batches): once this rank has finished
the step the row depends on (its own invalidations are done), and at most `distance` steps
before the use. At its placement
step a candidate the cache already holds at the wanted version is dropped (an expected hit);
the rest wait, per use step, until `issue_ready` finds their dependency committed on the PS and
issues one get for everything ready (`Fetch`). A fetch's rows (with their optimizer state
when the cache keeps any: `with_state`) stay in its own buffer, moved to the device once
(`materialize`), until the step assembly reads them; they enter the cache only through
admission at use. Candidates of step t still queued when t runs are dropped
(`drop_queued`): the step fetches those rows on demand.

Without a cache (read_mode ps) the scheduler only tracks the window (`entered`).

Thread safety: the scheduler has no lock of its own. Every method is called with the
controller's cache lock held (by the training thread or the step preparer's thread), except
`prepared_bytes`, which `metrics()` reads from any thread without it (over a copy of the
fetch list: a sum that may be a step old). It calls the PS through `PSPort` (whose client
lock it takes after the cache lock).

Invariants:
  1. Dependency gating (ARCHITECTURE §1 inv. 4): a get is issued only for keys whose
     dependency step <= the committed step read from the PS at issue time.
  2. Every issued fetch is drained: its handle is waited for before the fetch is forgotten
     (`retire`, `drop_fetches`), even when none of its rows was read.
  3. A fetch is registered under each of its use steps in `_by_use`; a use step's entry is
     removed when the step runs (`prefetched_for`), the fetch itself once its last use ran.
  4. Prefetching changes when rows are fetched, never what is cached: fetched rows reach the
     cache only through the step assembly's admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from torchrec_bagpipe.runtime.access_plans import StepPlan
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.ps_port import Handle, PSPort

__all__ = ["Candidates", "Fetch", "PrefetchScheduler", "PrefetchedPart"]


class Candidates(NamedTuple):
    """Keys of one use step that may be prefetched, with what the step expects of them."""

    keys: np.ndarray  # int64 fused keys
    deps: np.ndarray  # int64: each key's dependency step (the version the step reads)
    upos: np.ndarray  # int64: each key's index in the use step's unique keys
    use: int          # the step that reads them


@dataclass
class Fetch:
    """One issued prefetch get. Its rows stay in its own buffer until their steps read them
    (moved to the device once, by `PrefetchScheduler.materialize`)."""

    handle: Handle
    keys: np.ndarray
    uses: np.ndarray   # use step of each key
    upos: np.ndarray   # index of each key in its use step's unique keys
    min_use: int
    max_use: int
    rows: torch.Tensor | None = None  # on the device, once materialized


class PrefetchedPart(NamedTuple):
    """Rows of one fetch that a step reads: fetch rows `sel` are unique keys `upos`."""

    fetch: Fetch
    sel: np.ndarray
    upos: np.ndarray


def _i64(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


class PrefetchScheduler:
    def __init__(
        self,
        *,
        meta: Any,  # C.BagPipeCacheMetadata, or None without a cache
        port: PSPort,
        metrics: RuntimeMetrics,
        device: torch.device,
        distance: int,
        prepared_batches: int,
        lookahead: int = 0,
        adaptive: bool = False,
        with_state: bool = False,
        write_backs: Any = None,  # WriteBackLog (write-back aggregation), else None
    ) -> None:
        self._meta = meta
        self._wb = write_backs
        self._lookahead = lookahead
        self._adaptive = adaptive and meta is not None
        # Adaptive: the window stops growing after this many steps that inform nothing.
        self._probe_depth = max(lookahead, 1)
        self._probed: dict[int, StepPlan] = {}  # plans of probed steps not entered yet
        self._port = port
        self._with_state = with_state
        self._metrics = metrics
        self._device = device
        self._distance = distance
        self._prepared_batches = prepared_batches
        self.entered = -1                                   # last step in the window
        # ... and in its fixed part (up to t + lookahead): the same on every rank, whatever
        # an adaptive window's growth (which follows this rank's cache) added.
        self.fixed_end = -1
        self._ready: list[Candidates] = []                  # to place at the next step
        self._deferred: dict[int, list[Candidates]] = {}    # by placement step
        self._pend: dict[int, list[Candidates]] = {}        # placed, not issued; by use
        self._fetches: dict[int, Fetch] = {}                # by fetch id
        self._next_fid = 0
        self._by_use: dict[int, list[int]] = {}             # use step -> fetches with its rows

    # ---- candidates ---------------------------------------------------------------------
    def enter_window(self, t: int, last: int, plan_of: Callable[[int], StepPlan],
                     step_rows: int = 0) -> None:
        """Steps enter the window at step t: every submitted one up to t + lookahead, then
        (adaptive, under pressure: `step_rows`, step t's unique rows, do not fit beside the
        resident rows) the next ones up to `last` through the last one of those probed that
        would inform the cache (`_informs`).
        The cache learns their reads (`note_uses`), their keys become candidates.
        REQUIRES: `last` <= t + the window's bound, and submitted."""
        fixed = min(last, t + self._lookahead) if self._adaptive else last
        self.fixed_end = max(self.fixed_end, fixed)
        for s in range(self.entered + 1, fixed + 1):
            p = self._probed.pop(s, None)  # a probed plan is built once
            if s > t and self._meta is not None:
                p = p or plan_of(s)
            else:
                p = None  # step t itself, or no cache: nothing to note
            self._enter(t, s, p)
        if not self._adaptive or self.entered >= last:
            return
        if len(self._meta) + step_rows <= self._meta.capacity_rows:
            return  # no pressure, no decision to inform
        # Grow through the last step (of the next `probe_depth`) that informs the cache.
        probed = self._probed
        reach = self.entered
        s = self.entered + 1
        while s <= last and s - reach <= self._probe_depth:
            p = probed.get(s)
            if p is None:
                p = probed[s] = plan_of(s)
            if self._informs(t, p):
                reach = s
            s += 1
        for s in range(self.entered + 1, reach + 1):
            self._enter(t, s, probed.pop(s))

    def _informs(self, t: int, p: StepPlan) -> bool:
        """Whether step p.step (later than every known next use) would change a rank if it
        entered the window at step t: it reads a row the cache holds (this rank's previous
        read of it before t) with no known next use."""
        prev = p.prev_use
        held = (prev >= 0) & (prev < t)
        return bool(held.any()) and self._meta.count_unknown_next_uses(p.unique_keys[held]) > 0

    def _enter(self, t: int, s: int, p: StepPlan | None) -> None:
        """Step s (= entered + 1; p its plan, None for s <= t or without a cache) enters
        the window at step t."""
        self.entered = s
        if p is None:
            return
        noted = (p.prev_use >= 0) & (p.prev_use < t)
        if noted.any():
            self._meta.note_uses(p.unique_keys[noted], s)
        # A candidate is placed at step max(dep + 1, s - distance): once this rank has
        # finished its dependency, and at most `distance` steps before its use.
        when = np.maximum(p.deps + 1, s - self._distance)
        if when.size == 0:
            return
        lo = int(when.min())
        if lo == int(when.max()):
            groups: list[tuple[int, np.ndarray | None]] = [(lo, None)]
        else:
            groups = [(int(w), when == w) for w in np.unique(when)]
        for w, m in groups:
            if m is None:
                upos = np.arange(p.unique_keys.size, dtype=np.int64)
                cands = Candidates(p.unique_keys, p.deps, upos, s)
            else:
                upos = np.flatnonzero(m)
                cands = Candidates(p.unique_keys[upos], p.deps[upos], upos, s)
            if w <= t:
                self._ready.append(cands)
            else:
                self._deferred.setdefault(w, []).append(cands)

    def place(self, t: int) -> None:
        """Queues the candidates placed at step t that the cache does not hold at the
        version their step reads."""
        placed = self._deferred.pop(t, [])
        if self._ready:
            placed = self._ready + placed
            self._ready = []
        for keys, deps, upos, use in placed:
            if use <= t:  # the step's own keys are misses, fetched on demand
                continue
            if self._wb is not None:  # rows written back by now are read after that step
                deps = self._wb.deps(keys, deps)
            # Rows resident at the wanted version are expected hits; the rest are prefetched.
            need = self._meta.resident(keys, deps) < 0
            if need.all():
                self._pend.setdefault(use, []).append(Candidates(keys, deps, upos, use))
            elif need.any():
                self._pend.setdefault(use, []).append(
                    Candidates(keys[need], deps[need], upos[need], use))

    def drop_queued(self, t: int) -> None:
        """Step t runs: its candidates still waiting for their dependency are fetched on
        demand instead."""
        self._pend.pop(t, None)

    def issue_ready(self) -> None:
        """Issues one get for every queued candidate whose dependency has committed."""
        if not self._pend:
            return
        committed = self._port.committed()
        take: list[Candidates] = []
        for use in list(self._pend):
            stay: list[Candidates] = []
            for c in self._pend[use]:
                if c.deps.size == 0:
                    continue
                if int(c.deps.max()) <= committed:
                    take.append(c)
                    continue
                go = c.deps <= committed
                if go.any():
                    take.append(Candidates(c.keys[go], c.deps[go], c.upos[go], use))
                    stay.append(Candidates(c.keys[~go], c.deps[~go], c.upos[~go], use))
                else:
                    stay.append(c)
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
            k = np.concatenate([c.keys for c in take])
            d = np.concatenate([c.deps for c in take])
            up = np.concatenate([c.upos for c in take])
            u = np.concatenate([np.full(c.keys.size, c.use, dtype=np.int64) for c in take])
            uses_list = sorted({c.use for c in take})
        k = _i64(k)
        handle = self._port.get("prefetch", k, d, u, with_state=self._with_state)
        fid = self._next_fid
        self._next_fid += 1
        self._fetches[fid] = Fetch(handle, k, u, up, uses_list[0], uses_list[-1])
        for use in uses_list:
            self._by_use.setdefault(use, []).append(fid)
        self._metrics.add(prefetched=int(k.size), prefetch_gets=1)

    # ---- fetched rows -------------------------------------------------------------------
    def prefetched_for(self, t: int, missing: np.ndarray) -> list[PrefetchedPart]:
        """The fetched rows step t reads: those of its unique keys marked in `missing` (the
        cache misses) that a fetch holds; clears their marks."""
        parts: list[PrefetchedPart] = []
        for fid in self._by_use.pop(t, ()):
            f = self._fetches[fid]
            sel = np.flatnonzero(f.uses == t)
            upos = f.upos[sel]
            use = missing[upos]
            if not use.all():
                sel, upos = sel[use], upos[use]
            if upos.size:
                parts.append(PrefetchedPart(f, sel, upos))
                missing[upos] = False
        return parts

    def materialize(self, f: Fetch) -> torch.Tensor:
        """Waits for a fetch and moves its rows to the device (once)."""
        if f.rows is None:
            t0 = time.perf_counter()
            rows = self._port.wait_rows(f.handle, f.keys.size, self._with_state)
            self._metrics.add(fetch_wait_s=time.perf_counter() - t0,
                              staged_rows=int(f.keys.size))
            f.rows = rows if self._device.type == "cpu" else rows.to(self._device,
                                                                     non_blocking=True)
        return f.rows

    def retire(self, t: int) -> None:
        """Forgets the fetches whose last use is step t or earlier (draining unread ones)."""
        for fid in [fid for fid, f in self._fetches.items() if f.max_use <= t]:
            f = self._fetches.pop(fid)
            if f.rows is None:  # not read (its rows became hits): still drain the get
                self.materialize(f)

    def materialize_ready(self, t: int) -> None:
        """Moves finished fetches for the next prepared_batches steps to the device."""
        horizon = t + self._prepared_batches
        for f in list(self._fetches.values()):
            if f.rows is None and f.min_use <= horizon and f.handle.done():
                self.materialize(f)

    def drop_fetches(self, timeout: float) -> None:
        """Waits for every outstanding fetch (each bounded) and forgets them all."""
        errors = []
        for f in self._fetches.values():
            if f.rows is None:
                try:
                    f.handle.wait(timeout)
                except BaseException as e:  # keep draining the rest
                    errors.append(e)
        self._fetches.clear()
        self._by_use.clear()
        if errors:
            raise errors[0]

    def clear(self, timeout: float) -> None:
        """Forgets every fetch and candidate (after an external write to the PS)."""
        self.drop_fetches(timeout)
        self._ready = []
        self._deferred.clear()
        self._pend.clear()
        self._probed.clear()

    def prepared_bytes(self) -> int:
        """Device bytes of fetched rows waiting for their steps."""
        return sum(
            f.rows.numel() * f.rows.element_size()
            for f in list(self._fetches.values()) if f.rows is not None
        )
