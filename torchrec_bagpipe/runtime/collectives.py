"""The `Collectives` protocol the runtime is given, and `ThreadCollectives` (W ranks as threads).

The runtime never imports torch.distributed: the TorchRec layer injects an implementation
backed by a process group, and tests inject `ThreadCollectives`, which simulates W ranks as
threads of one process. Every wait is bounded; a rank that fails can `abort` the group so the
others raise at once instead of waiting for their timeout.

Contract of every implementation:
  * ``all_gather(t)``: ``t`` is 1-D of any length; returns one tensor per rank, rank order.
  * ``all_reduce_sum_(t)``: sums ``t`` over ranks in place; every rank ends with identical
    bits. `ThreadCollectives` sums in rank order (rank 0's tensor copied, then the others
    added), the order the parameter server uses, so collective aggregation is bitwise equal to
    the reference SGD.
  * ``barrier()``.
  * Every rank issues the same sequence of calls; a rank calling a different operation at the
    same position is an error (`ThreadCollectives` raises RuntimeError naming both).

Thread safety: the runtime calls an implementation from its communication worker only
(`worker.py`), one call at a time per rank. `ThreadGroup` guards its shared state with one
condition variable (`_cv`); each `ThreadCollectives` is used by one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CollectiveAborted", "Collectives", "ThreadCollectives", "ThreadGroup"]


@runtime_checkable
class Collectives(Protocol):
    rank: int
    world_size: int

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def all_reduce_sum_(self, t: torch.Tensor) -> None: ...

    def barrier(self) -> None: ...


class CollectiveAborted(RuntimeError):
    """Raised by every pending and later collective of a group another rank aborted."""


@dataclass
class _Op:
    kind: str
    inputs: list[Any]
    arrived: int = 0
    result: Any = None
    done: bool = False
    consumed: int = 0
    waiting: set[int] = field(default_factory=set)


class ThreadGroup:
    """Shared state of W simulated ranks; `collectives(r)` is rank r's handle."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self._cv = threading.Condition()
        self._ops: dict[int, _Op] = {}
        self._seq = [0] * world_size
        self._abort: BaseException | None = None

    def collectives(self, rank: int) -> ThreadCollectives:
        return ThreadCollectives(self, rank)

    def abort(self, reason: BaseException | str) -> None:
        """Makes every pending and later collective of the group raise CollectiveAborted."""
        with self._cv:
            if self._abort is None:
                self._abort = reason if isinstance(reason, BaseException) else RuntimeError(reason)
            self._cv.notify_all()

    def _rendezvous(
        self, rank: int, kind: str, payload: Any, combine: Callable[[list[Any]], Any]
    ) -> Any:
        deadline = time.monotonic() + self.timeout
        with self._cv:
            self._check_abort(rank, kind)
            seq = self._seq[rank]
            self._seq[rank] += 1
            op = self._ops.get(seq)
            if op is None:
                op = _Op(kind, [None] * self.world_size)
                self._ops[seq] = op
            if op.kind != kind:
                err = RuntimeError(
                    f"collective #{seq} mismatch: rank {rank} called {kind} while another rank "
                    f"called {op.kind}"
                )
                self._abort = err
                self._cv.notify_all()
                raise err
            op.inputs[rank] = payload
            op.arrived += 1
            if op.arrived == self.world_size:
                try:
                    op.result = combine(op.inputs)
                except BaseException as e:  # a bad payload fails every rank alike
                    op.result = e
                op.done = True
                op.inputs = []
                self._cv.notify_all()
            op.waiting.add(rank)
            while not op.done:
                self._check_abort(rank, kind)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self.world_size)) - op.waiting)
                    raise TimeoutError(
                        f"rank {rank}: {kind} (collective #{seq}) timed out after "
                        f"{self.timeout:.1f}s waiting for ranks {missing}"
                    )
                self._cv.wait(remaining)
            op.consumed += 1
            if op.consumed == self.world_size:
                del self._ops[seq]
            if isinstance(op.result, BaseException):
                raise op.result
            return op.result

    def _check_abort(self, rank: int, kind: str) -> None:
        if self._abort is not None:
            raise CollectiveAborted(
                f"rank {rank}: {kind} aborted because another rank failed: {self._abort!r}"
            )


class ThreadCollectives:
    """Rank `rank` of a `ThreadGroup`. Safe to call from any one thread per rank at a time."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        if not 0 <= rank < group.world_size:
            raise ValueError(f"rank must lie in [0, {group.world_size}), got {rank}")
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError("all_gather: expected a 1-D tensor")
        payload = t.detach().clone()
        result = self.group._rendezvous(self.rank, "all_gather", payload, list)
        return [x.clone() for x in result]

    def all_reduce_sum_(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError("all_reduce_sum_: expected a tensor")

        def combine(xs: list[torch.Tensor]) -> torch.Tensor:
            shape = xs[0].shape
            for r, x in enumerate(xs):
                if x.shape != shape or x.dtype != xs[0].dtype:
                    raise ValueError(
                        f"all_reduce_sum_: rank {r} sent {tuple(x.shape)} {x.dtype}, rank 0 "
                        f"sent {tuple(shape)} {xs[0].dtype}"
                    )
            acc = xs[0].clone()
            for x in xs[1:]:
                acc += x.to(acc.device)
            return acc

        result = self.group._rendezvous(self.rank, "all_reduce_sum", t.detach().clone(), combine)
        t.copy_(result)

    def barrier(self) -> None:
        self.group._rendezvous(self.rank, "barrier", None, lambda xs: None)
