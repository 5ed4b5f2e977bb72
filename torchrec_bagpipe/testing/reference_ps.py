"""An exact, in-process reference parameter server (numpy), used as the oracle in tests.

It implements the semantics of ARCHITECTURE §1/§3 with the simplest possible code:
  * every rank commits every step (possibly zero rows) with the step's learning rate; once
    all W ranks' payloads for step t are in, the gradients are concatenated in rank order,
    duplicate keys summed in that order (the first one copied), divided by W when gradient
    division is on (fp32 true division), and the table's optimizer updates each row and its
    state once at that lr (`reference_optimizer_step`: the contract of
    csrc/store/embedding_store.h in numpy, one fp32 rounding per operation; for plain SGD
    the bitwise arithmetic of §1); ranks that give one step different learning rates fail
    the session ("conflicting lr");
  * the committed step advances to t; a retry of a committed step is a no-op, a conflicting
    payload or an out-of-order step fails the session (`ReferenceSessionError`);
  * like the native client, a rank may commit step t + 1 before its commit of step t was
    applied: it waits in that rank's queue and is accepted once step t is committed (a
    step that does not follow the rank's last commit is out of order);
  * ``get_async(keys, at_step)`` reads once ``committed_step >= at_step`` (immediately when it
    already is, otherwise as soon as the commit lands), bounded by a timeout;
    ``with_state=True`` returns each row's optimizer state after its weights;
  * virtual tables: a commit may name keys evicted at its step's boundary (``evict=``); once
    the step is applied those rows go back to their initial value and state (the rows a
    fresh table holds: ``initial``), before any read of the step is served.

`ReferencePSClient` (one per rank) satisfies the runtime's ``PSClientLike`` protocol. The
server records every get (at_step and the committed step when it was issued) so tests can
check dependency gating against the truth.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

__all__ = [
    "ReferencePS",
    "ReferencePSClient",
    "ReferenceSessionError",
    "reference_optimizer_step",
    "reference_sgd_step",
]


class ReferenceSessionError(RuntimeError):
    """The reference PS session failed (conflicting retry, out-of-order step, closed)."""


def reference_sgd_step(
    values: np.ndarray,
    keys_by_rank: list[np.ndarray],
    grads_by_rank: list[np.ndarray],
    lr: float,
    world_size: int,
    divide: bool,
) -> None:
    """Applies one synchronous SGD step in place with the bitwise arithmetic of §1."""
    no_state = np.zeros((values.shape[0], 0), dtype=np.float32)
    reference_optimizer_step(values, no_state, keys_by_rank, grads_by_rank, lr, world_size,
                             divide, OptimizerSpec())


def _row_sums(x: np.ndarray) -> np.ndarray:
    """Row sums over the store's fixed pairwise tree (contract step 7), (n,) float32."""
    n, dim = x.shape
    width = 1
    while width < dim:
        width *= 2
    t = np.zeros((n, width), dtype=np.float32)
    t[:, :dim] = x
    while width > 1:
        width //= 2
        t = t[:, :width] + t[:, width:]
    return t[:, 0]


def reference_optimizer_step(
    values: np.ndarray,
    state: np.ndarray,
    keys_by_rank: list[np.ndarray],
    grads_by_rank: list[np.ndarray],
    lr: float,
    world_size: int,
    divide: bool,
    spec: OptimizerSpec,
) -> None:
    """Applies one synchronous step of `spec` in place to `values` (num_keys, dim) and
    `state` (num_keys, state_dim): every operation one float32 numpy operation, in the order
    of the arithmetic contract of csrc/store/embedding_store.h."""
    keys = np.concatenate([np.asarray(k, dtype=np.int64) for k in keys_by_rank])
    if keys.size == 0:
        return
    f = np.float32
    dim = values.shape[1]
    grads = np.concatenate(
        [np.asarray(g, dtype=np.float32).reshape(-1, dim) for g in grads_by_rank]
    )
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    acc = grads[first].copy()  # the first occurrence is copied, not added to zero
    rest = np.ones(keys.size, dtype=bool)
    rest[first] = False
    idx = np.nonzero(rest)[0]  # ascending: input order
    np.add.at(acc, inv[idx], grads[idx])
    w = values[uniq]
    s = state[uniq]
    lr32 = f(lr)
    with np.errstate(all="ignore"):  # NaN and inf follow the arithmetic
        u = acc
        if divide and world_size != 1:
            u = u / f(world_size)
        if spec.weight_decay != 0.0:
            u = u + w * f(spec.weight_decay)
        eps = f(spec.eps)
        if spec.kind == "sgd":
            w = w - u * lr32
        elif spec.kind == "adagrad":
            s = s + u * u
            w = w - (u / (np.sqrt(s) + eps)) * lr32
        elif spec.kind == "rowwise_adagrad":
            s = s + (_row_sums(u * u) / f(dim))[:, None]
            m = lr32 / (np.sqrt(s) + eps)
            w = w - u * m
        else:  # adam: state [m | v]
            m0, v0 = s[:, :dim], s[:, dim:]
            m1 = m0 + (u - m0) * f(1.0 - spec.beta1)
            v1 = v0 + (u * u - v0) * f(1.0 - spec.beta2)
            w = w - (m1 / (np.sqrt(v1) + eps)) * lr32
            s = np.concatenate([m1, v1], axis=1)
    values[uniq] = w
    if state.shape[1]:
        state[uniq] = s


class _Handle:
    def __init__(self, what: str, timeout: float) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._what = what
        self._timeout = timeout

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        limit = self._timeout if timeout is None else timeout
        if not self._event.wait(limit):
            raise TimeoutError(f"reference PS: {self._what} not done after {limit:.1f}s")
        if self._error is not None:
            raise self._error
        return self._value


@dataclass
class GetRecord:
    rank: int
    at_step: int
    committed_at_issue: int
    keys: np.ndarray


class ReferencePS:
    """W ranks' view of one fused table held in numpy arrays: the rows and their optimizer
    state (`optimizer`; every row starts from its initial state). `lr` is the learning rate
    of a commit that names none."""

    def __init__(
        self,
        num_keys: int,
        dim: int,
        world_size: int,
        lr: float,
        *,
        divide: bool = True,
        seed: int = 0,
        init: np.ndarray | None = None,
        timeout: float = 60.0,
        apply_delay: float = 0.0,
        record_gets: bool = True,
        optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
    ) -> None:
        if init is not None:
            init = np.asarray(init, dtype=np.float32)
            if init.shape != (num_keys, dim):
                raise ValueError(f"init must have shape {(num_keys, dim)}, got {init.shape}")
            self.values = init.copy()
        else:
            rng = np.random.default_rng(seed)
            self.values = rng.uniform(-0.5, 0.5, size=(num_keys, dim)).astype(np.float32)
        self.initial = self.values.copy()  # what an evicted row goes back to
        self.evicted_rows = 0
        self._pending_evict: dict[int, set[int]] = {}  # step -> keys evicted at its boundary
        self.num_keys = num_keys
        self.dim = dim
        self.optimizer = OptimizerSpec.of(optimizer)
        self.state_dim = self.optimizer.state_dim(dim)
        self.state = self.optimizer.initial_state(num_keys, dim).numpy()
        self.world_size = world_size
        self.lr = float(lr)
        self.divide = divide
        self.timeout = float(timeout)
        self.apply_delay = float(apply_delay)
        self.record_gets = record_gets
        self._cv = threading.Condition()
        self._committed = -1
        # Payloads: (keys, grads, lr) by rank.
        self._pending: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
        self._history: dict[int, dict[int, tuple[np.ndarray, np.ndarray, float]]] = {}
        self._commit_handles: dict[int, list[_Handle]] = {}
        self._waiting_gets: list[tuple[int, np.ndarray, _Handle, torch.Tensor | None, bool]] = []
        # Per rank: the last step accepted or queued, and commits waiting for their turn.
        self._last_step: dict[int, int] = {}
        self._queued: dict[int, deque[tuple[int, np.ndarray, np.ndarray, float, _Handle]]] = {}
        self._failed: BaseException | None = None
        self._apply_queue: deque[int] = deque()
        self._applier: threading.Thread | None = None
        self.gets: list[GetRecord] = []
        self.rows_served = 0
        self.rows_committed = 0
        self.closed_ranks: set[int] = set()
        if self.apply_delay > 0:
            self._applier = threading.Thread(target=self._apply_loop, daemon=True)
            self._applier.start()

    def client(self, rank: int) -> ReferencePSClient:
        return ReferencePSClient(self, rank)

    def committed_step(self) -> int:
        with self._cv:
            return self._committed

    def snapshot(self) -> np.ndarray:
        with self._cv:
            return self.values.copy()

    def snapshot_state(self) -> np.ndarray:
        """Every row's optimizer state, (num_keys, state_dim)."""
        with self._cv:
            return self.state.copy()

    def assign(self, keys: np.ndarray, rows: np.ndarray, with_state: bool = False) -> None:
        """Writes rows (weights; with their state after them when `with_state`)."""
        keys = np.asarray(keys, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.float32)
        with self._cv:
            self.values[keys] = rows[:, :self.dim]
            if with_state:
                self.state[keys] = rows[:, self.dim:]

    # ---- protocol ---------------------------------------------------------------------
    def _check_keys(self, keys: Any, what: str) -> np.ndarray:
        if isinstance(keys, torch.Tensor):
            if keys.dtype != torch.int64 or keys.dim() != 1:
                raise TypeError(f"{what}: keys must be a 1-D int64 tensor")
            keys = keys.detach().cpu().numpy()
        keys = np.asarray(keys)
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise TypeError(f"{what}: keys must be 1-D int64")
        if keys.size and (keys.min() < 0 or keys.max() >= self.num_keys):
            raise ValueError(f"{what}: keys outside [0, {self.num_keys})")
        return keys

    def commit(self, rank: int, step: int, keys: Any, grads: Any,
               lr: float | None = None, evict: Any = None) -> _Handle:
        keys = self._check_keys(keys, "commit")
        if evict is not None:
            ev = self._check_keys(evict, "commit evict")
            with self._cv:
                self._pending_evict.setdefault(int(step), set()).update(int(k) for k in ev)
        lr = self.lr if lr is None else float(lr)
        if not (np.isfinite(lr) and lr >= 0.0):
            raise ValueError(f"commit: lr must be finite and >= 0, got {lr}")
        if isinstance(grads, torch.Tensor):
            if grads.dtype != torch.float32:
                raise TypeError("commit: grads must be float32")
            grads = grads.detach().cpu().numpy()
        grads = np.asarray(grads, dtype=np.float32)
        if grads.shape != (keys.size, self.dim):
            raise ValueError(f"commit: grads must have shape {(keys.size, self.dim)}")
        handle = _Handle(f"commit of step {step} by rank {rank}", self.timeout)
        with self._cv:
            if self._failed is not None:
                raise ReferenceSessionError(f"session failed: {self._failed}")
            if rank in self.closed_ranks:
                raise ReferenceSessionError(f"rank {rank} closed its session")
            done_payload = self._history.get(step, {}).get(rank)
            receiving = self._committed + 1
            if done_payload is not None or (step == receiving and rank in self._pending):
                prev = done_payload if done_payload is not None else self._pending[rank]
                if not (np.array_equal(prev[0], keys) and np.array_equal(prev[1], grads)
                        and prev[2] == np.float32(lr)):
                    self._fail(f"conflicting retry of step {step} by rank {rank}")
                    raise ReferenceSessionError(f"conflicting retry of step {step} by rank {rank}")
                if step <= self._committed:
                    handle._set(step)
                else:
                    self._commit_handles.setdefault(step, []).append(handle)
                return handle
            last = self._last_step.get(rank, self._committed)
            if step == last + 1 and step > receiving:
                # Follows this rank's previous commit, which is not applied yet: queue it.
                self._queued.setdefault(rank, deque()).append(
                    (step, keys.copy(), grads.copy(), lr, handle))
                self._last_step[rank] = step
                return handle
            # Strict order: step t is accepted only once step t - 1 is applied.
            if step != receiving or receiving in self._history or last >= step:
                self._fail(f"rank {rank} committed step {step}, expected {receiving}")
                raise ReferenceSessionError(
                    f"out-of-order commit: rank {rank} sent step {step} while the committed "
                    f"step is {self._committed}"
                )
            self._last_step[rank] = step
            self._accept(rank, step, keys.copy(), grads.copy(), lr, handle)
        return handle

    def _accept(self, rank: int, step: int, keys: np.ndarray, grads: np.ndarray, lr: float,
                handle: _Handle) -> None:
        # REQUIRES: self._cv held; step == committed + 1.
        others = {p[2] for p in self._pending.values()}
        if others and others != {np.float32(lr)}:
            self._fail(f"conflicting lr: rank {rank} committed step {step} with lr {lr}, "
                       f"other ranks with {sorted(others)}")
            handle._set(error=self._failed)
            return
        self._pending[rank] = (keys, grads, np.float32(lr))
        self._commit_handles.setdefault(step, []).append(handle)
        if len(self._pending) == self.world_size:
            self._history[step] = self._pending
            self._pending = {}
            if self._applier is not None:
                self._apply_queue.append(step)
                self._cv.notify_all()
            else:
                self._apply(step)

    def _apply(self, step: int) -> None:
        # REQUIRES: self._cv held.
        payload = self._history[step]
        order = sorted(payload)
        reference_optimizer_step(
            self.values,
            self.state,
            [payload[r][0] for r in order],
            [payload[r][1] for r in order],
            float(payload[order[0]][2]),
            self.world_size,
            self.divide,
            self.optimizer,
        )
        self.rows_committed += sum(payload[r][0].size for r in order)
        gone = self._pending_evict.pop(step, None)
        if gone:
            idx = np.array(sorted(gone), dtype=np.int64)
            self.values[idx] = self.initial[idx]
            self.state[idx] = self.optimizer.initial_state(idx.size, self.dim).numpy()
            self.evicted_rows += idx.size
        # Keep only what a retry of a recent step needs.
        for old in [s for s in self._history if s < step - 4]:
            del self._history[old]
        self._committed = step
        for h in self._commit_handles.pop(step, []):
            h._set(step)
        still = []
        for at_step, keys, h, out, with_state in self._waiting_gets:
            if at_step <= self._committed:
                self._serve(keys, h, out, with_state)
            else:
                still.append((at_step, keys, h, out, with_state))
        self._waiting_gets = still
        self._cv.notify_all()
        # Queued commits of the next step now take their turn (after this step's gets).
        for rank in sorted(self._queued):
            q = self._queued[rank]
            if q and q[0][0] == self._committed + 1 and rank not in self._pending:
                nxt, keys, grads, lr, h = q.popleft()
                self._accept(rank, nxt, keys, grads, lr, h)

    def _serve(self, keys: np.ndarray, handle: _Handle, out: torch.Tensor | None,
               with_state: bool = False) -> None:
        # REQUIRES: self._cv held.
        self.rows_served += keys.size
        rows = self.values[keys]
        if with_state:
            rows = np.concatenate([rows, self.state[keys]], axis=1)
        rows = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        if out is not None:
            out.copy_(rows)
            rows = out
        handle._set(rows)

    def _apply_loop(self) -> None:
        while True:
            with self._cv:
                while not self._apply_queue:
                    self._cv.wait()
                step = self._apply_queue[0]
            time.sleep(self.apply_delay)
            with self._cv:
                self._apply_queue.popleft()
                self._apply(step)

    def _fail(self, why: str) -> None:
        self._failed = ReferenceSessionError(why)
        for hs in self._commit_handles.values():
            for h in hs:
                h._set(error=self._failed)
        self._commit_handles.clear()
        for q in self._queued.values():
            for *_, h in q:
                h._set(error=self._failed)
        self._queued.clear()

    def get(self, rank: int, keys: Any, at_step: int, out: torch.Tensor | None = None,
            with_state: bool = False) -> _Handle:
        keys = self._check_keys(keys, "get")
        width = self.dim + (self.state_dim if with_state else 0)
        if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (keys.size,
                                                                                   width)):
            raise ValueError(f"get: out must be float32 of shape {(keys.size, width)}")
        handle = _Handle(f"get of {keys.size} rows at step {at_step} by rank {rank}", self.timeout)
        with self._cv:
            if self._failed is not None:
                raise ReferenceSessionError(f"session failed: {self._failed}")
            if self.record_gets:
                self.gets.append(GetRecord(rank, int(at_step), self._committed, keys.copy()))
            if at_step <= self._committed:
                self._serve(keys, handle, out, with_state)
            else:
                self._waiting_gets.append((int(at_step), keys.copy(), handle, out, with_state))
        return handle

    def lookup(self, keys: Any, with_state: bool = False) -> torch.Tensor:
        keys = self._check_keys(keys, "lookup")
        with self._cv:
            rows = self.values[keys]
            if with_state:
                rows = np.concatenate([rows, self.state[keys]], axis=1)
            return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))

    def close_rank(self, rank: int) -> None:
        with self._cv:
            self.closed_ranks.add(rank)


class ReferencePSClient:
    """Rank `rank`'s client of a `ReferencePS` (the runtime's PSClientLike protocol)."""

    def __init__(self, server: ReferencePS, rank: int) -> None:
        self.server = server
        self.rank = rank
        self.dim = server.dim
        self.optimizer = server.optimizer
        self.state_dim = server.state_dim

    def get_async(self, keys: torch.Tensor, at_step: int, out: torch.Tensor | None = None, *,
                  with_state: bool = False) -> _Handle:
        return self.server.get(self.rank, keys, at_step, out, with_state)

    def commit_async(self, step: int, keys: torch.Tensor, grads: torch.Tensor,
                     lr: float | None = None, *, evict: torch.Tensor | None = None) -> _Handle:
        return self.server.commit(self.rank, step, keys, grads, lr, evict)

    def committed_step(self) -> int:
        return self.server.committed_step()

    def lookup(self, keys: torch.Tensor, timeout: float | None = None, *,
               with_state: bool = False) -> torch.Tensor:
        return self.server.lookup(keys, with_state)

    def assign(self, keys: torch.Tensor, rows: torch.Tensor, timeout: float | None = None, *,
               with_state: bool = False) -> None:
        self.server.assign(np.asarray(keys), np.asarray(rows), with_state)

    def assign_async(self, keys: torch.Tensor, rows: torch.Tensor, *,
                     with_state: bool = False) -> _Handle:
        """Applied at once (before any later commit of this rank); a done handle."""
        self.server.assign(np.asarray(keys), np.asarray(rows), with_state)
        h = _Handle("assign", self.server.timeout)
        h._set(None)
        return h

    def close(self) -> None:
        self.server.close_rank(self.rank)
