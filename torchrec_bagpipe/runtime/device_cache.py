"""DeviceCache: the row values of one rank's bounded cache, with torch ops only.

The same code runs on CPU and CUDA. It owns `values` (capacity_rows x dim, fp32) on the
trainer device; `BagPipeCacheMetadata` decides which slot holds which row, this class only
moves values:

  * `gather(slots)`: rows of resident slots;
  * `fill(slots, rows)`: writes fetched rows into their (distinct) slots;
  * `apply_gradients_(slots, grads, grad_rows=None)`: the one local update of resident rows
    (every aggregation strategy goes through it), with the PS's optimizer arithmetic — today
    SGD, bitwise as in ARCHITECTURE §1: ``u = g / W`` (true division by a *device* tensor, so
    CUDA never turns it into a reciprocal multiply; skipped when gradient division is off or
    W == 1), ``u = u * lr`` (an fp32 device tensor), ``w = w - u``: separate ops, the same
    roundings as the PS's C++ loop built with -ffp-contract=off. The last op is ``w += (-u)``
    through one `index_add_` (negation is exact and ``w + (-u)`` is by definition ``w - u``;
    the slots are distinct, so each row receives exactly one addition), which saves gathering
    and scattering the rows;
  * eviction is a clean discard: the PS is authoritative, nothing is written back.

Prefetched rows wait in their fetch's own buffer (`prefetch.py` moves it to the device once)
until their step reads them; they enter the cache only through admission at use, so
prefetching never displaces rows that are needed sooner.

Thread safety: none of its own. Only the training thread calls it (the step assembly, the
aggregations' updates), with one exception: collective aggregation updates S_later rows from
the communication worker, on slots pinned so that no other call touches them until the
training thread joins that update (`collective_aggregation.py`, invariant 2). The step
preparer's thread decides slots (metadata) but never touches values.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DeviceCache"]


class DeviceCache:
    def __init__(
        self,
        capacity_rows: int,
        dim: int,
        device: torch.device | str | None,
        *,
        lr: float,
        world_size: int,
        divide: bool,
    ) -> None:
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0, got {capacity_rows}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.capacity_rows = capacity_rows
        self.dim = dim
        self.values = torch.zeros(capacity_rows, dim, dtype=torch.float32, device=self.device)
        self.lr_t = torch.tensor(np.float32(lr), dtype=torch.float32, device=self.device)
        self.divisor_t = (
            torch.tensor(float(world_size), dtype=torch.float32, device=self.device)
            if divide and world_size != 1
            else None
        )

    # ---- slots ------------------------------------------------------------------------
    def index(self, slots: np.ndarray) -> torch.Tensor:
        """Slot numbers as an int64 tensor on the device."""
        t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def gather(self, slots: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """values[slots] (into `out`, a contiguous (len(slots), dim) tensor, if given)."""
        if out is None:
            return self.values.index_select(0, self.index(slots))
        return torch.index_select(self.values, 0, self.index(slots), out=out)

    def fill(self, slots: np.ndarray, rows: torch.Tensor) -> None:
        """values[slots] = rows.  REQUIRES: slots distinct, rows (len(slots), dim) fp32."""
        if len(slots) == 0:
            return
        self.values.index_copy_(0, self.index(slots), rows.to(self.device, non_blocking=True))

    def apply_gradients_(self, slots: np.ndarray, grads: torch.Tensor,
                         grad_rows: np.ndarray | None = None) -> None:
        """The local update of resident rows `slots` with gradient rows `grads[grad_rows]`
        (all of `grads` when None): the PS's arithmetic (§1).  REQUIRES: slots distinct."""
        if len(slots) == 0:
            return
        fresh = grad_rows is not None or grads.device != self.device
        if grad_rows is not None:
            index = torch.from_numpy(np.ascontiguousarray(grad_rows, dtype=np.int64))
            if grads.device.type != "cpu":
                index = index.to(grads.device, non_blocking=True)
            grads = grads.index_select(0, index)
        g = grads.to(self.device, non_blocking=True)
        # The same ops as the PS (u = g / W, u = u * lr, w = w - u), in one buffer of our
        # own: the gathered (or moved) rows in place, else a fresh one, since `g` is then the
        # caller's gradient, never written.
        if fresh:
            u = g
            if self.divisor_t is not None:
                u.div_(self.divisor_t)
            u.mul_(self.lr_t)
        elif self.divisor_t is not None:
            u = g / self.divisor_t
            u.mul_(self.lr_t)
        else:
            u = g * self.lr_t
        u.neg_()  # (index_add_'s alpha=-1 would take a slow path)
        self.values.index_add_(0, self.index(slots), u)

    @property
    def resident_bytes(self) -> int:
        return self.values.numel() * self.values.element_size()
