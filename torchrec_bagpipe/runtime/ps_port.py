"""PSPort: one controller's only path to its PS client (gets, commits, the committed step).

The runtime never names a transport: it is given an object satisfying `PSClientLike`
(`ps.PSClient`, or the exact `testing.reference_ps.ReferencePS` client in tests). The port
adds what every caller of that client inside the runtime needs:

  * `get(kind, keys, deps, uses, out=None, with_state=False)`: one get at the largest
    dependency step, reported first to the `fetch_observer` test hook (kind is "prefetch" or
    "demand"); `with_state` asks for each row's optimizer state after its weights (the rows
    a cache admits);
  * `wait_rows(handle, n, with_state=False)`: a get's rows, checked to be fp32 (n, dim) or
    (n, dim + state_dim), counted as fetched;
  * `commit(t, keys, grads, lr)`: submits step t's commit with the step's learning rate and
    remembers its handle, so that `poll_commits()` raises a failed commit's error and
    `drain_commits()` waits for all;
  * `write_back(keys, rows)` (write-back aggregation): rows with their optimizer state,
    assigned on the PS ahead of every later commit of this client; `poll_commits` and
    `drain_commits` cover them too;
  * `committed()`: the client's committed step (the last value seen once the port is closed);
  * the step numbering: the runtime numbers its steps from 0, the PS table may have
    committed steps before this session opened (a resumed job): runtime step t is PS step
    ``t + start_step + 1`` and the runtime's "no dependency" -1 is PS step `start_step`.

Thread safety: `get`, `commit`, `committed` and `close` may be called from any thread; the
client's methods are called under `_client_lock` only (the client's own calls are
serialized), and no handle is ever waited under it. `wait_rows`, `poll_commits` and
`drain_commits` are called by the training thread only.

Invariants:
  1. Every client call (get_async, commit_async, committed_step, close) runs under
     `_client_lock`; the lock is a leaf: nothing else is acquired while it is held.
  2. A get is issued at ``max(deps)`` (or -1 for no keys' dependency), never earlier: the
     client serves it once that step committed (dependency gating, ARCHITECTURE §1 inv. 4).
  3. Commit and write-back handles are appended in submission order (`deque.append` from
     the training thread or the communication worker) and removed only by the training
     thread.
  4. Steps cross to the client shifted by ``start_step + 1`` (above), both ways; the fetch
     observer sees runtime steps.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from torchrec_bagpipe.runtime.metrics import RuntimeMetrics

__all__ = ["FetchObserver", "Handle", "PSClientLike", "PSPort"]


class Handle(Protocol):
    def wait(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


class PSClientLike(Protocol):
    dim: int
    state_dim: int  # optimizer state floats per row of the table

    def get_async(self, keys: torch.Tensor, at_step: int, out: torch.Tensor | None = None, *,
                  with_state: bool = False) -> Handle: ...

    def commit_async(self, step: int, keys: torch.Tensor, grads: torch.Tensor,
                     lr: float | None = None) -> Handle: ...
    # Virtual tables also pass `evict=` (keys evicted at the step's boundary).

    def committed_step(self) -> int: ...

    def close(self) -> None: ...
    # Write-back aggregation also calls `assign_async(keys, rows, with_state=True)`.


# Test hook: called as (kind, keys, deps, uses, at_step) before each get.
FetchObserver = Callable[[str, np.ndarray, np.ndarray, np.ndarray, int], None]


class PSPort:
    def __init__(self, ps: PSClientLike, *, dim: int, state_dim: int, timeout: float,
                 metrics: RuntimeMetrics, start_step: int = -1,
                 send_evictions: bool = False) -> None:
        self._ps = ps
        self._send_evictions = send_evictions  # virtual tables: this rank sends them
        self._shift = start_step + 1  # invariant 4
        self._dim = dim
        self._state_dim = state_dim
        self._timeout = timeout
        self._metrics = metrics
        self._client_lock = threading.Lock()
        self._commits: deque[Handle] = deque()  # submitted, not known to be done
        self._last_committed = -1
        self._closed = False
        self.fetch_observer: FetchObserver | None = None

    # ---- gets ---------------------------------------------------------------------------
    def get(self, kind: str, keys: np.ndarray, deps: np.ndarray, uses: np.ndarray,
            out: torch.Tensor | None = None, with_state: bool = False) -> Handle:
        """Issues one get at the largest dependency step (the rows land in `out` if given;
        with their optimizer state after the weights when `with_state` and the table keeps
        any)."""
        at_step = int(deps.max()) if deps.size else -1
        if self.fetch_observer is not None:
            self.fetch_observer(kind, keys, deps, uses, at_step)
        kw = {"with_state": True} if with_state and self._state_dim else {}
        with self._client_lock:
            if out is None:
                return self._ps.get_async(torch.from_numpy(keys), at_step + self._shift, **kw)
            return self._ps.get_async(torch.from_numpy(keys), at_step + self._shift, out=out,
                                      **kw)

    def wait_rows(self, handle: Handle, n: int, with_state: bool = False) -> torch.Tensor:
        """The rows of a get of n keys (bounded wait); a wrong shape or dtype is a ValueError."""
        width = self._dim + (self._state_dim if with_state else 0)
        rows = handle.wait(self._timeout)
        if not isinstance(rows, torch.Tensor):
            rows = torch.as_tensor(np.asarray(rows))
        if rows.dtype != torch.float32 or tuple(rows.shape) != (n, width):
            raise ValueError(
                f"the PS returned rows of shape {tuple(rows.shape)} {rows.dtype}, expected "
                f"({n}, {width}) float32"
            )
        self._metrics.add(fetched_bytes=n * width * 4)
        return rows

    # ---- commits ------------------------------------------------------------------------
    def commit(self, t: int, keys: torch.Tensor, grads: torch.Tensor, lr: float,
               evicted: np.ndarray | None = None) -> None:
        """Submits step t's commit at learning rate `lr`. The client starts it once its
        previous commit completed (ARCHITECTURE §3, client rules), so nobody waits here.
        `evicted` (virtual tables: the keys evicted at t's boundary) rides the commit of the
        one rank that sends them (`send_evictions`); the PS erases them as it applies t."""
        with self._client_lock:
            if self._send_evictions and evicted is not None and evicted.size:
                handle = self._ps.commit_async(t + self._shift, keys, grads, lr=lr,
                                               evict=torch.from_numpy(evicted))
            else:
                handle = self._ps.commit_async(t + self._shift, keys, grads, lr=lr)
        self._commits.append(handle)
        self._metrics.add(gradient_payload_bytes=keys.numel() * 8 + grads.numel() * 4)

    def write_back(self, keys: np.ndarray, rows: torch.Tensor, *, flush: bool = False) -> None:
        """Assigns rows (weights, then optimizer state: [n, dim + state_dim] fp32 CPU) to
        `keys` on the PS, ahead of every commit this client sends later. Counted as evicted
        rows' write-backs, or with `flush` as a drain's."""
        if not keys.size:
            return
        kw = {"with_state": True} if self._state_dim else {}
        with self._client_lock:
            handle = self._ps.assign_async(torch.from_numpy(keys), rows, **kw)
        self._commits.append(handle)
        nbytes = int(keys.size) * (8 + rows.shape[1] * 4)
        if flush:
            self._metrics.add(flushed_rows=int(keys.size), flush_bytes=nbytes)
        else:
            self._metrics.add(written_back_rows=int(keys.size), write_back_bytes=nbytes)

    def poll_commits(self) -> None:
        """Raises a failed commit's (or write-back's) error; forgets those known done."""
        while self._commits and self._commits[0].done():
            self._commits.popleft().wait(self._timeout)

    def drain_commits(self) -> None:
        """Waits until every submitted commit is committed and every write-back applied
        (each wait bounded)."""
        while self._commits:
            self._commits[0].wait(self._timeout)
            self._commits.popleft()

    def committed(self) -> int:
        """The client's committed step (min over shards); after `close`, the last one seen."""
        if self._closed:
            return self._last_committed
        with self._client_lock:
            self._last_committed = int(self._ps.committed_step()) - self._shift
        return self._last_committed

    # ---- lifetime -----------------------------------------------------------------------
    def mark_closed(self) -> None:
        """From now on `committed()` answers the last value seen, without the client."""
        self._closed = True

    def close_client(self) -> None:
        with self._client_lock:
            self._ps.close()
