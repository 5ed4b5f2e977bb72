"""DeviceCache: the row values of one rank's bounded cache, with torch ops only.

The same code runs on CPU and CUDA. It owns `values` (capacity_rows x dim, fp32) on the
trainer device; `BagPipeCacheMetadata` decides which slot holds which row, this class only
moves values:

  * `gather(slots)`: rows of resident slots;
  * `fill(slots, rows)`: writes fetched rows into their (distinct) slots;
  * `sgd_(slots, grads)`: the local SGD of resident rows with the bitwise arithmetic of
    ARCHITECTURE §1: ``u = g / W`` (true division by a *device* tensor, so CUDA never turns it
    into a reciprocal multiply; skipped when gradient division is off or W == 1),
    ``u = u * lr`` (an fp32 device tensor), ``w = w - u``: three separate ops, the same
    roundings as the PS's C++ loop built with -ffp-contract=off;
  * eviction is a clean discard: the PS is authoritative, nothing is written back;
  * a bounded queue of prepared batches: rows prefetched for the next `max_prepared` steps
    wait here until their step; admission into the cache happens at use (so prefetching never
    displaces rows that are needed sooner), and a batch larger than the cache is gathered from
    hits, this queue and demand fetches into its own tensor.

Thread safety: the owner serializes calls (the controller holds its lock around them).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

__all__ = ["DeviceCache", "sgd_update"]


def sgd_update(
    w: torch.Tensor, g: torch.Tensor, lr_t: torch.Tensor, divisor_t: torch.Tensor | None
) -> torch.Tensor:
    """`w - (g / divisor) * lr` as three separate fp32 ops (the PS's exact roundings)."""
    u = g / divisor_t if divisor_t is not None else g
    u = u * lr_t
    return w - u


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
        max_prepared: int = 2,
    ) -> None:
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0, got {capacity_rows}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if max_prepared < 1:
            raise ValueError(f"max_prepared must be >= 1, got {max_prepared}")
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
        self.max_prepared = max_prepared
        self._prepared: OrderedDict[int, tuple[np.ndarray, torch.Tensor]] = OrderedDict()

    # ---- slots ------------------------------------------------------------------------
    def index(self, slots: np.ndarray) -> torch.Tensor:
        """Slot numbers as an int64 tensor on the device."""
        t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def gather(self, slots: np.ndarray) -> torch.Tensor:
        return self.values.index_select(0, self.index(slots))

    def fill(self, slots: np.ndarray, rows: torch.Tensor) -> None:
        """values[slots] = rows.  REQUIRES: slots distinct, rows (len(slots), dim) fp32."""
        if len(slots) == 0:
            return
        self.values.index_copy_(0, self.index(slots), rows.to(self.device, non_blocking=True))

    def sgd_(self, slots: np.ndarray, grads: torch.Tensor) -> None:
        """Local SGD of resident rows (§1 arithmetic).  REQUIRES: slots distinct."""
        if len(slots) == 0:
            return
        idx = self.index(slots)
        w = self.values.index_select(0, idx)
        g = grads.to(self.device, non_blocking=True)
        self.values.index_copy_(0, idx, sgd_update(w, g, self.lr_t, self.divisor_t))

    @property
    def resident_bytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    # ---- prepared batches -------------------------------------------------------------
    def can_prepare(self, step: int, current: int) -> bool:
        """Whether rows for `step` may be staged now (within the queue's bound)."""
        return step - current <= self.max_prepared

    def put_prepared(
        self, step: int, keys: np.ndarray, rows: torch.Tensor, *, current: int
    ) -> None:
        """Stages fetched rows for `step` (appended to the step's earlier ones).

        REQUIRES: current <= step <= current + max_prepared (ValueError otherwise).
        """
        if not current <= step or not self.can_prepare(step, current):
            raise ValueError(
                f"prepared-batch queue: step {step} is outside [{current}, "
                f"{current + self.max_prepared}] (max_prepared={self.max_prepared})"
            )
        rows = rows.to(self.device, non_blocking=True)
        if step in self._prepared:
            k0, r0 = self._prepared[step]
            self._prepared[step] = (np.concatenate([k0, keys]), torch.cat([r0, rows]))
        else:
            self._prepared[step] = (keys, rows)

    def take_prepared(self, step: int) -> tuple[np.ndarray, torch.Tensor] | None:
        return self._prepared.pop(step, None)

    @property
    def prepared_steps(self) -> int:
        return len(self._prepared)

    @property
    def prepared_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for _, r in self._prepared.values())

    def clear(self) -> None:
        self._prepared.clear()
