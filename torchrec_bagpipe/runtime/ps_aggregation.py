"""PSAggregation: every rank commits its own step gradients; the PS sums them (``ps``).

After step t a rank updates the resident rows only it touched, weights and optimizer state,
with its own gradient at the step's learning rate (`DeviceCache.apply_gradients_`: bitwise
the PS's result, since the PS applies the same arithmetic to the same sum) and sets their
version to t; resident rows another rank touched
are invalidated (it knows them from the exchanged ids: `StepPlan.others`). Then it commits
its unique-row gradients to the PS.

The metadata part (`plan_finish`: which slots get the local update, their version t, the
invalidations) depends on the plan only, so it runs when step t is prepared; `finish` applies
the gradient to those slots and commits.

Thread safety: `before_step`, `finish`, `drain` run on the training thread; `plan_finish`
runs with the controller's cache lock held (on the step preparer's thread or the training
thread). `finish` writes row values without the lock: only the training thread writes them.

Invariants:
  1. The local update reaches exactly the rows of keys no other rank touched at step t
     (`~plan.shared`) resident when step t was prepared; they end at version t, bitwise the
     PS's row after commit t. (A slot evicted and reassigned by a later step's preparation
     receives the update first and its new row afterwards: both on the training thread, in
     step order.)
  2. Every resident row another rank touched at step t is invalidated before step t + 1 is
     prepared.
  3. The commit carries a private CPU copy of the gradient: the caller may reuse its buffer.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np
import torch

from torchrec_bagpipe.runtime.access_plans import StepPlan
from torchrec_bagpipe.runtime.aggregation import Aggregation
from torchrec_bagpipe.runtime.device_cache import DeviceCache
from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
from torchrec_bagpipe.runtime.ps_port import PSPort

__all__ = ["LocalUpdate", "PSAggregation"]

_EMPTY = np.zeros(0, dtype=np.int64)


class LocalUpdate(NamedTuple):
    """The resident rows step t updates locally: cache slots and their gradient rows."""

    slots: np.ndarray
    grad_rows: np.ndarray


class PSAggregation(Aggregation):
    def __init__(
        self,
        *,
        meta: Any,  # C.BagPipeCacheMetadata, or None without a cache
        cache: DeviceCache,
        cache_lock: threading.RLock,
        port: PSPort,
        metrics: RuntimeMetrics,
    ) -> None:
        self._meta = meta
        self._cache = cache
        self._cache_lock = cache_lock
        self._port = port
        self._metrics = metrics

    def before_step(self, t: int) -> None:
        self._port.poll_commits()

    def plan_finish(self, t: int, plan: StepPlan) -> LocalUpdate:
        if self._meta is None:
            return LocalUpdate(_EMPTY, _EMPTY)
        U = plan.unique_keys
        slots = local = _EMPTY
        with self._cache_lock:
            local = np.flatnonzero(~plan.shared)
            if local.size:
                slots = self._meta.lookup(U[local] if local.size != U.size else U)
                have = slots >= 0
                if not have.all():
                    local, slots = local[have], slots[have]
                if slots.size:
                    self._meta.set_version(slots, t)
                self._metrics.add(local_updates=int(slots.size))
            if plan.others.size:
                freed = self._meta.invalidate(plan.others)
                self._metrics.add(invalidations=int(freed.size))
        return LocalUpdate(slots, local)

    def finish(self, t: int, plan: StepPlan, grad: torch.Tensor, planned: LocalUpdate,
               lr: float) -> None:
        if planned.slots.size:
            self._cache.apply_gradients_(planned.slots, grad, planned.grad_rows, lr=lr)
        # A private copy: the caller may reuse its gradient buffer before the commit runs.
        grads_cpu = grad.detach().to("cpu", copy=True)
        self._port.commit(t, torch.from_numpy(plan.unique_keys), grads_cpu, lr, plan.evicted)

    def drain(self) -> None:
        self._port.drain_commits()

    def close(self) -> None:
        pass  # nothing runs on the worker; the commits are the PS client's
