"""IdExchange: every rank's ids of each step, exchanged, turned into this rank's access plans.

The plans (`access_plans.StepPlan`) of a step need every rank's keys of that step and of the
lookahead window after it. They come one of two ways:

  * prescan: `prescan(local_trace)` all-gathers every rank's whole trace once (one collective,
    before training) and builds a `PrescanPlanner`; each later `submit` is checked against it;
  * online: each `submit(s, keys)` queues one worker task that all-gathers the batch's
    distinct keys (int32 when the fused keys fit) with every rank and adds step s to the
    `OnlinePlanner`; `absorb(t, upto)` waits (bounded) until every step <= upto is planned,
    then releases the steps before t.

Thread safety: `prescan`, `check`, `submit`, `complete` and `cancel` are called by the
training thread, `absorb` and `plan` by whichever thread prepares a step (the step preparer's
or the training thread, one at a time; `complete` only once no step is being prepared);
`_exchange_and_plan` runs on the communication worker; `plan_seconds` and `memory_bytes` may
be called from any thread. `_pending` is appended by `submit` and popped by `absorb` (atomic
deque operations). `_plan_lock` guards the online planner (the worker adds steps while plans
are read and steps released); the prescan planner is written once, by `prescan`, before any
submit, and only read afterwards.

Invariants:
  1. Steps enter the online planner in submission order: one FIFO worker runs the exchanges
     (`worker.py`), and `_exchange_and_plan` checks the step the planner assigns.
  2. `_plan_lock` is a leaf lock: nothing else is acquired while it is held.
  3. A plan read by the training thread is a copy; the fields it uses do not depend on steps
     added past its window (next_use beyond the window is masked by the step assembly), so
     adding steps early changes no decision: online plans equal prescan plans.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np
import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.runtime.access_plans import OnlinePlanner, PrescanPlanner, StepPlan
from torchrec_bagpipe.runtime.collectives import Collectives
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.worker import MeteredWorker, wait_task

__all__ = ["IdExchange"]

_INT32_KEYS = (1 << 31) - 1  # fused keys below this travel as int32 in ID exchanges


def _in_context(e: Exception, message: str) -> Exception:
    """`e`'s class with `message` (callers catching a TimeoutError or CollectiveAborted
    still do), or a RuntimeError where the class cannot be built from a message."""
    try:
        out = type(e)(message)
    except Exception:
        return RuntimeError(message)
    return out if isinstance(out, Exception) and str(out) == message else RuntimeError(message)


class PendingExchange(NamedTuple):
    """An online exchange queued on the worker and not yet awaited."""

    step: int
    future: Future


class IdExchange:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        lookahead: int,
        num_keys: int,
        collective: bool,
        collectives: Collectives,
        worker: MeteredWorker,
        metrics: RuntimeMetrics,
        timeout: float,
        eviction: dict | None = None,
        replicated: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._planner_kw = dict(world_size=world_size, rank=rank, lookahead=lookahead,
                                num_keys=num_keys, collective=collective, eviction=eviction,
                                replicated=replicated)
        self._coll = collectives
        self._worker = worker
        self._metrics = metrics
        self._timeout = timeout
        self._online = OnlinePlanner(**self._planner_kw)
        self._prescan: PrescanPlanner | None = None
        self._plan_lock = threading.Lock()
        self._pending: deque[PendingExchange] = deque()
        self._dtype = np.int32 if num_keys <= _INT32_KEYS else np.int64

    @property
    def prescanned(self) -> bool:
        return self._prescan is not None

    # ---- prescan ------------------------------------------------------------------------
    def prescan(self, local: list[np.ndarray], *, progress: bool) -> None:
        """All-gathers every rank's trace (`local[t]`: this rank's validated keys at step t)
        and plans every step.  REQUIRES: nothing submitted yet."""
        lens = np.array([len(local)] + [a.size for a in local], dtype=np.int64)
        packed = torch.from_numpy(np.concatenate([lens, *local]) if local else lens)
        parts = self._collect(self._coll.all_gather, packed)
        self._metrics.add(id_exchange_bytes=packed.numel() * 8, collectives_issued=1)
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

    def _collect(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs the prescan's collective on the worker and waits for it (bounded)."""
        t0 = time.perf_counter()
        fut = self._worker.submit(fn, *args)
        try:
            return wait_task(fut, self._timeout, lambda t: self._awaited(
                "the prescan's ID exchange (an all_gather of every rank's whole trace)", fut, t))
        finally:
            self._metrics.add(collective_wait_s=time.perf_counter() - t0)

    def _awaited(self, what: str, fut: Future, waited: float) -> str:
        """The message of a wait for `fut` that timed out after `waited` seconds: this rank,
        `what`, and the peers it awaits (a collective completes once every rank took part)."""
        others = [q for q in range(self.world_size) if q != self.rank]
        peers = (f"rank {others[0]}" if len(others) == 1 else f"ranks {others}")
        culprit = f"rank {others[0]}" if len(others) == 1 else "one of them"
        where = ("in the collective" if fut.running()
                 else "still queued behind earlier collectives on the communication worker")
        return (f"rank {self.rank} of {self.world_size}: {what} did not complete within "
                f"{waited:g} s: it awaits {peers} ({where}); {culprit} died, hung or stopped "
                "submitting batches")

    def waiting_for(self, waited: float) -> str | None:
        """The timeout message of the online exchange a step's preparation waits for (the
        oldest one not done) after `waited` seconds, or None if none is outstanding."""
        for pending in list(self._pending):
            if not pending.future.done():
                return self._awaited(self._exchange_name(pending.step), pending.future, waited)
        return None

    def _failed_exchange(self, step: int) -> str:
        others = [q for q in range(self.world_size) if q != self.rank]
        peers = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
        return (f"rank {self.rank} of {self.world_size}: {self._exchange_name(step)} failed "
                f"while awaiting {peers} (a peer that died or failed)")

    @staticmethod
    def _exchange_name(step: int) -> str:
        return (f"the online ID exchange of step {step} (an all_gather of every rank's keys of "
                f"batch {step})")

    # ---- per batch ----------------------------------------------------------------------
    def check(self, s: int, keys: np.ndarray) -> None:
        """Raises what `submit(s, keys)` would raise for this batch (a prescan mismatch),
        without submitting it."""
        if self._prescan is not None:
            self._prescan.check(s, keys)

    def submit(self, s: int, keys: np.ndarray) -> None:
        """Batch s (validated, owned) enters: checked against the prescan, or exchanged and
        planned on the worker (off the training thread)."""
        if self._prescan is not None:
            self._prescan.check(s, keys)
        else:
            fut = self._worker.submit(self._exchange_and_plan, s, keys)
            self._pending.append(PendingExchange(s, fut))

    def _exchange_and_plan(self, s: int, own: np.ndarray) -> None:
        """Runs on the worker (FIFO, so steps are added in order): exchanges batch s with
        every rank and adds it to the online planner.

        The other ranks' planners need this batch's distinct keys only (first-occurrence
        order keeps every rank's plans identical to prescan's) and its id count.
        """
        unique = C.unique_keys(own)
        msg = np.empty(unique.size + 1, dtype=self._dtype)
        msg[0] = own.size
        msg[1:] = unique
        self._metrics.add(id_exchange_bytes=msg.nbytes, collectives_issued=1)
        try:
            parts = self._coll.all_gather(torch.from_numpy(msg))
        except Exception as e:  # the process group's own error (a peer's connection reset)
            raise _in_context(e, f"{self._failed_exchange(s)}: {e}") from e
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

    def absorb(self, t: int, upto: int) -> None:
        """Online: waits until every batch with step <= upto is exchanged and planned, then
        forgets the steps before t. Prescan: nothing to do."""
        if self._prescan is not None:
            return
        while self._pending and self._pending[0].step <= upto:
            step, fut = self._pending[0]
            t0 = time.perf_counter()
            try:
                wait_task(fut, self._timeout,
                          lambda t, s=step, f=fut: self._awaited(self._exchange_name(s), f, t))
            finally:
                self._metrics.add(collective_wait_s=time.perf_counter() - t0)
            self._pending.popleft()
        with self._plan_lock:
            self._online.release(t)

    def plan(self, s: int) -> StepPlan:
        """This rank's plan of step s.  REQUIRES: s planned (absorbed) and not released."""
        if self._prescan is not None:
            return self._prescan.plan(s)
        with self._plan_lock:
            return self._online.plan(s)

    def complete(self) -> None:
        """Close: waits for the exchange of every batch submitted and not yet absorbed (each
        wait bounded). Every rank submitted the same batches, so each rank's worker runs the
        same collectives and no peer is left waiting in one; a peer that submitted fewer
        makes this raise TimeoutError naming the step."""
        while self._pending:
            pending = self._pending[0]
            what = (f"ID exchange of submitted batch {pending.step} (rank {self.rank}) at "
                    "close")
            hint = "another rank closed without submitting it (every rank must submit the "\
                   "same batches)"
            try:
                pending.future.result(timeout=self._timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"{what} did not complete within {self._timeout}s: {hint}") from None
            except Exception as e:
                raise RuntimeError(f"{what} failed ({e!r}): {hint}") from e
            self._pending.popleft()

    def cancel(self) -> None:
        """Cancels the exchanges not started yet (close)."""
        for pending in self._pending:
            pending.future.cancel()

    # ---- accounting ---------------------------------------------------------------------
    @property
    def plan_seconds(self) -> float:
        return self._online.plan_seconds + (
            self._prescan.plan_seconds if self._prescan is not None else 0.0
        )

    def memory_bytes(self) -> int:
        if self._prescan is not None:
            return self._prescan.memory_bytes()
        with self._plan_lock:
            return self._online.memory_bytes()

    def eviction_stats(self) -> dict[str, int]:
        """Virtual tables: the eviction rule's live, created and evicted rows (as planned:
        up to the newest step added, which runs ahead of training by the window)."""
        if self._prescan is not None:
            return self._prescan.eviction_stats()
        with self._plan_lock:
            return self._online.eviction_stats()
