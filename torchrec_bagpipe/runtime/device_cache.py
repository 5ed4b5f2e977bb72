"""DeviceCache: the rows of one rank's bounded cache, with their optimizer state, in torch ops.

The same code runs on CPU and CUDA. It owns `rows` (capacity_rows x width, fp32) on the
trainer device, ``width = dim + state_dim``: each slot holds a row's weights followed by its
optimizer state (none for SGD), the layout in which the PS serves rows "with state"
(csrc/protocol/wire.h invariant 5), so a fetched row lands in its slot in one copy.
`BagPipeCacheMetadata` decides which slot holds which row; this class only moves values:

  * `gather(slots)`: rows (with state) of resident slots;
  * `fill(slots, rows)`: writes fetched rows (with state) into their (distinct) slots;
  * `apply_gradients_(slots, grads, grad_rows=None, *, lr)`: the one local update of
    resident rows (every aggregation strategy goes through it), with the PS's optimizer
    arithmetic (`row_update.row_update`: the contract of csrc/store/embedding_store.h,
    bit for bit) at the step's learning rate, on weights and state together. Plain SGD
    without weight decay keeps the fast path of ARCHITECTURE §1: ``u = g / W`` (true
    division by a *device* tensor, so CUDA never turns it into a reciprocal multiply; skipped
    when gradient division is off or W == 1), ``u = u * lr`` (an fp32 device tensor),
    ``w = w - u`` as ``w += (-u)`` through one `index_add_` (negation is exact and
    ``w + (-u)`` is by definition ``w - u``; the slots are distinct, so each row receives
    exactly one addition), which saves gathering and scattering the rows;
  * eviction and invalidation are a clean discard of weights and state together: the PS is
    authoritative, nothing is written back.

Prefetched rows (with state) wait in their fetch's own buffer (`prefetch.py` moves it to the
device once) until their step reads them; they enter the cache only through admission at
use, so prefetching never displaces rows that are needed sooner.

Thread safety: none of its own. Only the training thread calls it (the step assembly, the
aggregations' updates), with one exception: collective aggregation updates S_later rows from
the communication worker, on slots pinned so that no other call touches them until the
training thread joins that update (`collective_aggregation.py`, invariant 2). The step
preparer's thread decides slots (metadata) but never touches values.

Invariants:
  1. A slot's weights and state change together: by `fill` (a fetched row) or by
     `apply_gradients_` (one optimizer step), never one without the other.
  2. After `apply_gradients_(slots, g, lr=lr)` a slot holds bitwise what the PS's store
     computes for that row from the same summed gradient, divisor and lr.
"""

from __future__ import annotations

import numpy as np
import torch

from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.runtime.row_update import row_update

__all__ = ["DeviceCache"]

_SGD = OptimizerSpec()


class DeviceCache:
    def __init__(
        self,
        capacity_rows: int,
        dim: int,
        device: torch.device | str | None,
        *,
        world_size: int,
        divide: bool,
        optimizer: OptimizerSpec = _SGD,
    ) -> None:
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0, got {capacity_rows}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if not isinstance(optimizer, OptimizerSpec):
            raise TypeError(f"optimizer must be an OptimizerSpec, got {type(optimizer).__name__}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.capacity_rows = capacity_rows
        self.dim = dim
        self.optimizer = optimizer
        self.state_dim = optimizer.state_dim(dim)
        self.width = dim + self.state_dim
        self.rows = torch.zeros(capacity_rows, self.width, dtype=torch.float32,
                                device=self.device)
        self.divisor = world_size if divide else 1
        self.divisor_t = (
            torch.tensor(float(world_size), dtype=torch.float32, device=self.device)
            if self.divisor != 1
            else None
        )
        # Plain SGD needs neither the rows nor a state to update: the index_add_ fast path.
        self._fast_sgd = optimizer.kind == "sgd" and optimizer.weight_decay == 0.0
        # Learning rates (and their negations) as device tensors, by (value, sign). Read and
        # written by the training thread and the worker (collective S_later) at once: single
        # dict operations only.
        self._lr_ts: dict[tuple[float, float], torch.Tensor] = {}

    # ---- slots ------------------------------------------------------------------------
    def index(self, slots: np.ndarray) -> torch.Tensor:
        """Slot numbers as an int64 tensor on the device."""
        t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def gather(self, slots: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """rows[slots], (len(slots), width), into `out` (a contiguous tensor) if given."""
        if out is None:
            return self.rows.index_select(0, self.index(slots))
        return torch.index_select(self.rows, 0, self.index(slots), out=out)

    def fill(self, slots: np.ndarray, rows: torch.Tensor) -> None:
        """rows[slots] = rows.  REQUIRES: slots distinct, rows (len(slots), width) fp32."""
        if len(slots) == 0:
            return
        self.rows.index_copy_(0, self.index(slots), rows.to(self.device, non_blocking=True))

    def _lr_tensor(self, lr: float, sign: float = 1.0) -> torch.Tensor:
        """The step's learning rate (times `sign`, +1 or -1: negation is exact) as an fp32
        device tensor (made once per value while a few are in use: an LR schedule changes it
        every step at most)."""
        t = self._lr_ts.get((lr, sign))
        if t is None:
            t = torch.tensor(np.float32(sign) * np.float32(lr), dtype=torch.float32,
                             device=self.device)
            if len(self._lr_ts) >= 8:
                self._lr_ts = {}
            self._lr_ts[(lr, sign)] = t
        return t

    def apply_gradients_(self, slots: np.ndarray, grads: torch.Tensor,
                         grad_rows: np.ndarray | None = None, *, lr: float) -> None:
        """The local update of resident rows `slots` (weights and state) with gradient rows
        `grads[grad_rows]` (all of `grads` when None) at learning rate `lr`: the PS's
        arithmetic (invariant 2).  REQUIRES: slots distinct."""
        if len(slots) == 0:
            return
        fresh = grad_rows is not None or grads.device != self.device
        if grad_rows is not None:
            index = torch.from_numpy(np.ascontiguousarray(grad_rows, dtype=np.int64))
            if grads.device.type != "cpu":
                index = index.to(grads.device, non_blocking=True)
            grads = grads.index_select(0, index)
        g = grads.to(self.device, non_blocking=True)
        idx = self.index(slots)
        if self._fast_sgd:
            # The same ops as the PS (u = g / W, u = u * lr, w = w - u), in one buffer of our
            # own: the gathered (or moved) rows in place, else a fresh one, since `g` is then
            # the caller's gradient, never written. w - u is added as w + (u * -lr):
            # IEEE rounding is sign-symmetric, so u * -lr is -(u * lr) bit for bit, one pass
            # fewer than a separate negation (index_add_'s alpha=-1 takes a slow path).
            neg_lr = self._lr_tensor(float(lr), -1.0)
            if fresh:
                u = g
                if self.divisor_t is not None:
                    u.div_(self.divisor_t)
                u.mul_(neg_lr)
            elif self.divisor_t is not None:
                u = g / self.divisor_t
                u.mul_(neg_lr)
            else:
                u = g * neg_lr
            self.rows.index_add_(0, idx, u)
            return
        lr_t = self._lr_tensor(float(lr))
        cur = self.rows.index_select(0, idx)
        w, state = row_update(cur[:, :self.dim], cur[:, self.dim:], g, lr_t, self.divisor,
                              self.optimizer)
        self.rows.index_copy_(0, idx, torch.cat([w, state], dim=1) if self.state_dim else w)

    @property
    def resident_bytes(self) -> int:
        """Device bytes of the cache's rows, optimizer state included."""
        return self.rows.numel() * self.rows.element_size()
