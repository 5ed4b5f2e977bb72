"""Table IO: the rows of a BagPipe-sharded module's tables in the PS, read and written by range.

Ranges are table-relative (`[start, stop)` within one table's `num_embeddings` rows) and go
to the PS in requests of at most `chunk_rows` rows, through each fused table's
`FusedTableRuntime` (the one path to the PS):

* `read_rows(table, start, stop)` / `write_rows(table, start, rows)`: one range, after every
  pending commit (fused_table_runtime.py invariant 1), weights only or with each row's
  optimizer state (`with_state`);
* `write_initial_weights`: the unsharded module's weights into the PS at sharding (rank 0
  writes), except fused tables whose every table is on `meta` with TorchRec's default init:
  the PS initialises those itself, lazily and deterministically.

The state dict's live tensors and loads (table_state.py) read and write through it.

Thread-safety: the rank's training thread; `write_initial_weights` is a collective (every
rank calls it in the same order).

Invariants:
1. No PS request moves more than `chunk_rows` rows.
2. After `write_initial_weights` returns on any rank, every write it covers is in the PS.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchrec_bagpipe.distributed.fused_table_runtime import FusedTableRuntime
from torchrec_bagpipe.distributed.job import BagPipeJob
from torchrec_bagpipe.distributed.layout import FusedLayout
from torchrec_bagpipe.distributed.types import TableSpec

__all__ = ["TABLE_CHUNK_ROWS", "TableIO", "default_uniform"]

# Rows per PS request when reading or writing table ranges (read when a TableIO is built:
# also the largest local shard of a table's live state-dict tensors).
TABLE_CHUNK_ROWS = 1 << 16


def default_uniform(init_fn: Callable[[torch.Tensor], Any] | None, table: TableSpec) -> bool:
    """Whether `init_fn` is TorchRec's default symmetric uniform init for the table."""
    if not isinstance(init_fn, functools.partial) or init_fn.func is not torch.nn.init.uniform_:
        return False
    a = init_fn.keywords.get("a")
    b = init_fn.keywords.get("b")
    return (
        a is not None and b is not None and math.isclose(-float(a), float(b))
        and math.isclose(float(b), table.init_max)
    )


class TableIO:
    """Reads and writes the module's tables in the PS (see module docstring)."""

    def __init__(self, layout: FusedLayout, runtimes: Sequence[FusedTableRuntime],
                 job: BagPipeJob, chunk_rows: int | None = None) -> None:
        if chunk_rows is None:
            chunk_rows = TABLE_CHUNK_ROWS
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self._layout = layout
        self._runtimes = list(runtimes)
        self._job = job
        self.chunk_rows = chunk_rows

    def shape(self, table: str) -> tuple[int, int]:
        t = self._layout.table(table)
        return (t.num_embeddings, t.dim)

    # ---- ranges -----------------------------------------------------------------------------
    def read_rows(self, table: str, start: int, stop: int, *,
                  with_state: bool = False) -> torch.Tensor:
        """Rows [start, stop) of `table` ([stop - start, dim] fp32, CPU; with `with_state`
        [.., dim + state_dim]: each row's optimizer state after its weights), after every
        pending commit. REQUIRES: no step running."""
        t = self._check(table, start, stop)
        rt = self._runtimes[self._layout.group_of(table)]
        base = self._layout.fused_start(table)
        parts = [
            rt.read_rows(base + lo, base + min(stop, lo + self.chunk_rows), with_state=with_state)
            for lo in range(start, stop, self.chunk_rows)
        ]
        width = t.dim + (rt.state_dim if with_state else 0)
        return torch.cat(parts) if parts else torch.empty(0, width)

    def write_rows(self, table: str, start: int, rows: torch.Tensor, *,
                   with_state: bool = False) -> None:
        """Writes `rows` ([n, dim]: stored rows keep their optimizer state; with `with_state`
        [n, dim + state_dim]) as rows [start, start + n) of `table`, from this rank. Caches
        stay stale until every rank invalidates (`finish_load`). REQUIRES: no step running."""
        self._check(table, start, start + int(rows.shape[0]))
        rt = self._runtimes[self._layout.group_of(table)]
        base = self._layout.fused_start(table)
        n = int(rows.shape[0])
        for lo in range(0, n, self.chunk_rows):
            hi = min(n, lo + self.chunk_rows)
            rt.write_rows(base + start + lo, rows[lo:hi], with_state=with_state)

    # ---- initial weights --------------------------------------------------------------------
    def write_initial_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        init_fns: Mapping[str, Callable[[torch.Tensor], Any] | None],
    ) -> None:
        """Puts the unsharded module's weights (by table; `meta` tensors for tables not
        materialised) into the PS. A `meta` table is left to the PS's lazy init when every
        table of its fused table is `meta` with TorchRec's default init; otherwise it is
        materialised with its `init_fn` on rank 0, like DMP would. A job resuming from a
        whole-job checkpoint writes nothing: the PS restored the tables' rows."""
        if self._job.resumed is not None:
            return
        wrote = False
        for spec in self._layout.fused:
            if spec.eviction is not None:
                # Virtual tables: rows exist only once trained, from the PS's lazy init.
                for t in spec.tables:
                    if not default_uniform(init_fns[t.name], t):
                        raise ValueError(
                            f"virtual table {t.name!r} has a custom init_fn; its rows are "
                            "created on the PS when first trained, uniform in "
                            "±weight_init_max: drop init_fn (set weight_init_max instead)"
                        )
                continue
            lazy = all(weights[t.name].is_meta and default_uniform(init_fns[t.name], t)
                       for t in spec.tables)
            for t in spec.tables:
                meta = weights[t.name].is_meta
                if meta and lazy:
                    continue
                wrote = True
                if self._job.rank != 0:
                    continue
                if meta:
                    init_fn = init_fns[t.name]
                    if init_fn is None:
                        raise ValueError(
                            f"BagPipe table {t.name!r} is on the meta device and has no "
                            "init_fn to materialise it"
                        )
                    weight = torch.empty(t.num_embeddings, t.dim)
                    init_fn(weight)
                else:
                    weight = weights[t.name].detach()
                self.write_rows(t.name, 0, weight)
        # Every rank waits until rank 0's writes are in the PS before any step reads them.
        if wrote:
            self._job.control.barrier()

    def _check(self, table: str, start: int, stop: int) -> TableSpec:
        t = self._layout.table(table)
        if not 0 <= start <= stop <= t.num_embeddings:
            raise ValueError(
                f"BagPipe table {table!r}: rows [{start}, {stop}) lie outside "
                f"[0, {t.num_embeddings})"
            )
        return t
