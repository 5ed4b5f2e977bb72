"""Access plans: what one rank reads at each global step, from the planners over the ID trace.

Two planners, prescan (the whole ID trace before training) and online (a window), both wrap
the native `StepPlanner` (csrc/cache/step_planner.h) and yield the same `StepPlan` objects: for
one rank and one global step, its unique keys and inverse, each key's dependency step (the
last global step before this one that touched it; -1 never), whether another rank touches it
in the same step, its next read inside the lookahead window (rows to keep; -1: a prime
eviction victim, either unused in the window or invalidated by another rank first), the keys
other ranks touch of which this rank holds a valid copy (what it invalidates), and for
collective aggregation the global union with its S_now rows. Replicated (write-back
aggregation): every rank's plan is the union's, as if the rank read every rank's keys
(unique_keys = union_keys; `inverse` maps its own batch into them; `own_pos` / `own_inverse`
give its own unique keys and batch; step_planner.h inv. 10).

Prescan keeps every plan in CPU memory (proportional to the trace) and checks each submitted
batch against it; online adds one step per exchanged batch and releases executed steps. Where
the other ranks' keys come from is `id_exchange.py`'s business.

Thread safety: none. A planner is owned by one `IdExchange`, which serializes the calls.
A `StepPlan` is immutable and owns its arrays, so it may be read from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from torchrec_bagpipe._native import C

__all__ = [
    "OnlinePlanner",
    "PlanMismatchError",
    "PrescanPlanner",
    "StepPlan",
    "as_key_array",
]


class PlanMismatchError(ValueError):
    """A submitted batch differs from the prescanned trace."""


def as_key_array(keys: torch.Tensor | np.ndarray | Sequence[int], what: str) -> np.ndarray:
    """A 1-D contiguous int64 numpy view of `keys` (zero-copy for CPU tensors)."""
    if isinstance(keys, torch.Tensor):
        if keys.dtype != torch.int64:
            raise TypeError(f"{what} must have dtype torch.int64, got {keys.dtype}")
        if keys.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(keys.shape)}")
        arr = keys.detach().cpu().contiguous().numpy()
    else:
        arr = np.asarray(keys)
        if arr.size == 0 and arr.dtype != np.int64:
            arr = arr.astype(np.int64)
        if arr.dtype != np.int64:
            raise TypeError(f"{what} must have dtype int64, got {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
        arr = np.ascontiguousarray(arr)
    return arr


@dataclass(frozen=True)
class StepPlan:
    """One rank's plan for one global step (numpy arrays, owned by the plan)."""

    step: int
    rank: int
    unique_keys: np.ndarray  # int64 [U], first-occurrence order
    inverse: np.ndarray      # int64 [B]: batch position -> index into unique_keys
    deps: np.ndarray         # int64 [U]: last global step < step touching the key; -1 never
    next_use: np.ndarray     # int64 [U]: next read in the window with a valid copy; -1 none
    prev_use: np.ndarray     # int64 [U]: previous read whose copy is still valid; -1 none
    shared: np.ndarray       # bool [U]: another rank touches the key at this step too
    others: np.ndarray       # int64: keys other ranks touch at this step of which this rank
                             # holds a valid copy: what it invalidates (ps aggregation)
    union_keys: np.ndarray   # int64: every rank's keys (collective aggregation)
    union_pos: np.ndarray    # int64 [U]: index of each unique key in union_keys (collective)
    s_now: np.ndarray        # bool [len(union_keys)]: read again at step + 1 (collective)
    global_ids: int          # ids of all ranks at this step, duplicates included
    union_size: int
    evicted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # int64, sorted: keys evicted at this
                             # step's boundary (virtual tables; the same on every rank)
    own_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # replicated only: this rank's own unique keys (first-occurrence order) as indices into
    # unique_keys (the union) ...
    own_inverse: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # ... and its batch as indices into own_pos

    @property
    def keep(self) -> np.ndarray:
        """Mask of unique keys read again inside the window (worth keeping)."""
        return self.next_use >= 0

    @property
    def evict(self) -> np.ndarray:
        return self.next_use < 0

    @staticmethod
    def from_native(d: dict, rank: int) -> StepPlan:
        return StepPlan(
            step=int(d["step"]),
            rank=rank,
            unique_keys=d["unique"],
            inverse=d["inverse"],
            deps=d["dep"],
            next_use=d["next_use"],
            prev_use=d["prev_use"],
            shared=d["shared"].astype(bool),
            others=d["others"],
            union_keys=d["union_keys"],
            union_pos=d["union_pos"],
            s_now=d["s_now"].astype(bool),
            global_ids=int(d["global_ids"]),
            union_size=int(d["union_size"]),
            evicted=d["evicted"],
            own_pos=d["own_pos"],
            own_inverse=d["own_inverse"],
        )


class _PlannerBase:
    def __init__(
        self, *, world_size: int, rank: int, lookahead: int, num_keys: int, collective: bool,
        eviction: dict | None = None, replicated: bool = False,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.lookahead = lookahead
        self.num_keys = num_keys
        self.collective = collective
        self._native = C.StepPlanner(world_size, rank, lookahead, num_keys, collective,
                                     eviction=eviction, replicated=replicated)
        self.plan_seconds = 0.0  # time spent in the native planner

    @property
    def num_steps(self) -> int:
        return int(self._native.num_steps)

    def plan(self, step: int) -> StepPlan:
        return StepPlan.from_native(self._native.plan(step), self.rank)

    def memory_bytes(self) -> int:
        return int(self._native.memory_bytes())

    def eviction_stats(self) -> dict[str, int]:
        """Virtual tables: live, created and evicted rows and eviction rounds so far."""
        return dict(self._native.eviction_stats())

    def add_step(self, per_rank: Sequence[np.ndarray], *, global_ids: int = -1) -> int:
        """Adds the next step from each rank's keys (rank order). -> the step.

        Another rank's keys may be its distinct keys in first-occurrence order (the plan is
        the same); `global_ids` then gives the step's id count with duplicates.
        """
        if len(per_rank) != self.world_size:
            raise ValueError(f"expected {self.world_size} ranks' keys, got {len(per_rank)}")
        arrays = [as_key_array(k, f"keys of rank {q}") for q, k in enumerate(per_rank)]
        offsets = np.zeros(self.world_size + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        t0 = time.perf_counter()
        step = int(self._native.add_step(flat, offsets, global_ids))
        self.plan_seconds += time.perf_counter() - t0
        return step


class OnlinePlanner(_PlannerBase):
    """Adds steps as their batches are exchanged; `release(upto)` drops executed steps."""

    def release(self, upto: int) -> None:
        self._native.release(upto)


class PrescanPlanner(_PlannerBase):
    """Plans every step of a whole trace before training and checks batches against it."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._local: list[np.ndarray] = []
        self.startup_seconds = 0.0

    def build(
        self,
        trace: Sequence[Sequence[np.ndarray]],
        *,
        progress: bool = True,
        chunk_steps: int = 64,
    ) -> None:
        """Plans `trace[t][q]` = rank q's keys at step t, with a tqdm progress bar.

        REQUIRES: no step added yet; every rank's keys 1-D int64 within [0, num_keys).
        """
        if self.num_steps != 0:
            raise ValueError("prescan: the planner already holds steps")
        t0 = time.perf_counter()
        steps = len(trace)
        bar = None
        if progress and steps:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc=f"BagPipe prescan (rank {self.rank})", unit="step",
                       leave=False)
        try:
            for start in range(0, steps, chunk_steps):
                block = trace[start : start + chunk_steps]
                arrays: list[np.ndarray] = []
                for t, per_rank in enumerate(block, start=start):
                    if len(per_rank) != self.world_size:
                        raise ValueError(
                            f"prescan: step {t} has {len(per_rank)} ranks' keys, expected "
                            f"{self.world_size}"
                        )
                    for q, k in enumerate(per_rank):
                        arrays.append(as_key_array(k, f"prescan trace step {t} rank {q}"))
                offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
                np.cumsum([a.size for a in arrays], out=offsets[1:])
                flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
                self._native.add_steps(flat, offsets)
                for per_rank in block:
                    self._local.append(as_key_array(per_rank[self.rank], "keys").copy())
                if bar is not None:
                    bar.update(len(block))
        finally:
            if bar is not None:
                bar.close()
        self.startup_seconds = time.perf_counter() - t0
        self.plan_seconds += self.startup_seconds

    def check(self, step: int, keys: np.ndarray) -> None:
        """Raises PlanMismatchError naming step and rank when `keys` differs from the trace."""
        if step >= len(self._local):
            raise PlanMismatchError(
                f"prescan plan mismatch at step {step} on rank {self.rank}: the prescanned "
                f"trace has only {len(self._local)} steps"
            )
        want = self._local[step]
        if want.shape != keys.shape or not np.array_equal(want, keys):
            if want.shape != keys.shape:
                detail = f"{keys.size} ids submitted, {want.size} planned"
            else:
                pos = int(np.nonzero(want != keys)[0][0])
                detail = f"position {pos}: id {int(keys[pos])} submitted, {int(want[pos])} planned"
            raise PlanMismatchError(
                f"prescan plan mismatch at step {step} on rank {self.rank}: {detail}"
            )
