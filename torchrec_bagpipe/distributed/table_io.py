"""Table IO: the rows of a BagPipe-sharded module's tables in the PS, read and written by range.

Ranges are table-relative (`[start, stop)` within one table's `num_embeddings` rows) and go
to the PS in requests of at most `chunk_rows` rows, through each fused table's
`FusedTableRuntime` (the one path to the PS):

* `read_rows(table, start, stop)` / `write_rows(table, start, rows)`: one range, after every
  pending commit (fused_table_runtime.py invariant 1), weights only or with each row's
  optimizer state (`with_state`);
* `optimizer_state(table)`: the table's optimizer state in TorchRec's layout
  (`table_optimizer.state_tensors`), read in bounded chunks (issue 12 turns this into live,
  PS-backed state-dict tensors);
* `load_table` / `load_optimizer_state` / `finish_load`: a state-dict load (weights, or
  optimizer state: each row's weights are read back and written with the new state); rank 0
  writes the values every rank was given, then every rank meets in a barrier and drops its
  cached rows;
* `write_initial_weights`: the unsharded module's weights into the PS at sharding (rank 0
  writes), except fused tables whose every table is on `meta` with TorchRec's default init:
  the PS initialises those itself, lazily and deterministically.

Thread-safety: the rank's training thread; `load_table`, `finish_load` and
`write_initial_weights` are collectives (every rank calls them in the same order).

Invariants:
1. No PS request moves more than `chunk_rows` rows.
2. After `finish_load` (or `write_initial_weights`) returns on any rank, every write it
   covers is in the PS and no rank's cache holds a row older than it.
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
from torchrec_bagpipe.distributed.table_optimizer import state_columns, state_tensors
from torchrec_bagpipe.distributed.types import TableSpec

__all__ = ["TABLE_CHUNK_ROWS", "TableIO", "default_uniform"]

# Rows per PS request when reading or writing table ranges.
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
                 job: BagPipeJob, chunk_rows: int = TABLE_CHUNK_ROWS) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self._layout = layout
        self._runtimes = list(runtimes)
        self._job = job
        self._chunk = chunk_rows
        self._loaded = False

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
            rt.read_rows(base + lo, base + min(stop, lo + self._chunk), with_state=with_state)
            for lo in range(start, stop, self._chunk)
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
        for lo in range(0, n, self._chunk):
            hi = min(n, lo + self._chunk)
            rt.write_rows(base + start + lo, rows[lo:hi], with_state=with_state)

    # ---- optimizer state ------------------------------------------------------------------------
    def optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """The table's optimizer state in TorchRec's layout ({} for SGD), read in chunks of at
        most `chunk_rows` rows after every pending commit. REQUIRES: no step running."""
        t = self._layout.table(table)
        rt = self._runtimes[self._layout.group_of(table)]
        if rt.state_dim == 0:
            return {}
        rows = self.read_rows(table, 0, t.num_embeddings, with_state=True)
        return state_tensors(t.optimizer, t.dim, rows[:, t.dim:])

    def load_optimizer_state(self, table: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """One table's optimizer state of a state-dict load (every rank, same values; TorchRec's
        layout): rank 0 writes it, keeping the rows' weights; the load ends with
        `finish_load`. REQUIRES: no step running."""
        t = self._layout.table(table)
        rt = self._runtimes[self._layout.group_of(table)]
        where = f"BagPipe table {table!r}"
        columns = state_columns(t.optimizer, t.dim, tensors, t.num_embeddings, where)
        if rt.state_dim == 0:
            return
        rt.flush()
        if self._job.rank == 0:
            for lo in range(0, t.num_embeddings, self._chunk):
                hi = min(t.num_embeddings, lo + self._chunk)
                rows = self.read_rows(table, lo, hi, with_state=True)
                rows[:, t.dim:] = columns[lo:hi]
                self.write_rows(table, lo, rows, with_state=True)
        self._loaded = True

    # ---- state-dict loads ---------------------------------------------------------------------
    def load_table(self, table: str, value: torch.Tensor) -> None:
        """One table of a state-dict load (every rank, same values): rank 0 writes it; the
        load ends with `finish_load`. REQUIRES: no step running; `value` has the table's shape."""
        self._runtimes[self._layout.group_of(table)].flush()
        if self._job.rank == 0:
            self.write_rows(table, 0, value)
        self._loaded = True

    def finish_load(self) -> None:
        """After the tables (or optimizer states) of a load: every rank waits until rank 0's
        writes are in, then drops its cached rows (a no-op when nothing was loaded since the
        last call)."""
        if not self._loaded:
            return
        self._loaded = False
        self._job.control.barrier()
        for rt in self._runtimes:
            rt.invalidate()

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
