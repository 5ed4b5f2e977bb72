"""`TableState`: the live state-dict tensors of a module's BagPipe tables and their loads.

A BagPipe table's `state_dict()` entry, and each of its optimizer-state entries
(``momentum1``, Adam's ``exp_avg_sq``), is a row-wise `ShardedTensor` of `PSTensor` views
(ps_views.py) onto the PS: rank r's local shards are TorchRec's row-wise block of rows of
rank r, in shards of at most `TableIO.chunk_rows` rows. Nothing is read when a state dict
is taken; a read of a view reads its rows (after the commits of finished steps: a pending
step stays pending), a write (`copy_`, in place; refused while a training forward waits
for its backward) writes them, as TorchRec's convention and DCP's load expect.
Whole-tensor loads (`load_weight`, `load_optimizer_state`: plain tensors of the table's
shape, or sharded tensors whose local shards say which rows they hold) write this rank's
rows of the value the same way.

Writes bypass every rank's cache, so the ranks settle once a write phase ends: a state-dict
read (or a load) opens a phase on every rank (taking a module's state dict is collective,
as for every TorchRec sharded module under DCP); the module's next use (`settle`, before
its next batch, flush, close, or at the end of a `load_state_dict`) closes it with one
all-reduce on the job's control group (bounded by its timeout): when any rank wrote, every
rank drops its cached rows.

Thread-safety: the rank's training thread.

Invariants:
1. Every read or write through a view moves at most `chunk_rows` rows per PS request and
   runs after the owner's `drain` (every finished step's commit applied; a write only with
   no forward waiting for its backward).
2. After `settle` returns on any rank, every write made before any rank's `settle` is in
   the PS and no rank's cache holds a row older than it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from torchrec_bagpipe.distributed.fused_table_runtime import FusedTableRuntime
from torchrec_bagpipe.distributed.job import BagPipeJob
from torchrec_bagpipe.distributed.layout import FusedLayout
from torchrec_bagpipe.distributed.ps_views import PSTensor, row_blocks, row_wise_sharded
from torchrec_bagpipe.distributed.table_io import TableIO
from torchrec_bagpipe.distributed.table_optimizer import state_entries

__all__ = ["TableState"]


class _TableRows:
    """A `RowStore` over one table's rows in the PS: weights, or weights and optimizer state
    (`with_state`), through `TableIO` after the owner's drain."""

    def __init__(self, owner: TableState, table: str, width: int, with_state: bool) -> None:
        self._owner = owner
        self.table = table
        self.rows = owner.io.shape(table)[0]
        self.width = width
        self.chunk_rows = owner.io.chunk_rows
        self.with_state = with_state

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._owner.drain(False)
        return self._owner.io.read_rows(self.table, start, stop, with_state=self.with_state)

    def write(self, start: int, rows: torch.Tensor) -> None:
        self._owner.drain(True)
        self._owner.wrote = True
        self._owner.io.write_rows(self.table, start, rows, with_state=self.with_state)


class TableState:
    """Live state-dict tensors and loads of a module's BagPipe tables (module docstring).

    Args:
        layout, io, runtimes, job: the module's tables, their `TableIO`, runtimes and job.
        drain: called before every read (`drain(False)`) and write (`drain(True)`) of PS
            rows: the owner checks it may (a write raises while a forward waits for its
            backward).
        on_settle: called on every rank at the end of `settle` (the fused optimizer's step
            counts written in place, e.g. by DCP).
    """

    def __init__(self, layout: FusedLayout, io: TableIO, runtimes: list[FusedTableRuntime],
                 job: BagPipeJob, drain: Callable[[bool], None],
                 on_settle: Callable[[], None] | None = None) -> None:
        self.layout = layout
        self.io = io
        self._runtimes = runtimes
        self._job = job
        self.drain = drain
        self._on_settle = on_settle
        self._stores: dict[tuple[str, bool], _TableRows] = {}
        self.open_phase = False  # a state dict was taken or a load began (every rank)
        self.wrote = False  # this rank wrote rows since the last settle

    def _store(self, table: str, with_state: bool) -> _TableRows:
        store = self._stores.get((table, with_state))
        if store is None:
            t = self.layout.table(table)
            rt = self._runtimes[self.layout.group_of(table)]
            width = t.dim + (rt.state_dim if with_state else 0)
            store = self._stores[(table, with_state)] = _TableRows(self, table, width,
                                                                   with_state)
        return store

    # ---- live tensors ---------------------------------------------------------------------------
    def weight(self, table: str) -> ShardedTensor:
        """The table's weights: a row-wise ShardedTensor of live PS views."""
        self.open_phase = True
        store = self._store(table, False)
        return row_wise_sharded(lambda a, b: PSTensor(store, a, b, 0, store.width),
                                [store.rows, store.width], store.chunk_rows,
                                group=self._job.control.group)

    def optimizer_state(self, table: str) -> dict[str, ShardedTensor]:
        """The table's optimizer state in TorchRec's layout ({} for SGD): row-wise
        ShardedTensors of live PS views (``momentum1``; Adam's ``exp_avg_sq``)."""
        t = self.layout.table(table)
        entries = state_entries(t.optimizer, t.dim)
        if not entries:
            return {}
        self.open_phase = True
        store = self._store(table, True)
        out: dict[str, ShardedTensor] = {}
        for key, (c0, c1, vector) in entries.items():
            size = [store.rows] if vector else [store.rows, c1 - c0]
            out[key] = row_wise_sharded(
                lambda a, b, c0=c0, c1=c1, vector=vector: PSTensor(
                    store, a, b, t.dim + c0, t.dim + c1, drop_col=vector),
                size, store.chunk_rows, group=self._job.control.group)
        return out

    # ---- loads ----------------------------------------------------------------------------------
    def load_weight(self, table: str, value: torch.Tensor) -> None:
        """Writes this rank's rows of `value` (the table's shape: a plain tensor, or a
        ShardedTensor: its local shards) into the table. The load ends with `settle` on
        every rank. REQUIRES: `value` has the table's shape."""
        self.open_phase = True
        store = self._store(table, False)
        self._write(store, value, 0, False)

    def load_optimizer_state(self, table: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Writes this rank's rows of a table's optimizer-state entries (TorchRec's layout;
        plain tensors or ShardedTensors). A missing or misshapen entry is a ValueError
        naming it, before anything is written. The load ends with `settle`."""
        t = self.layout.table(table)
        entries = state_entries(t.optimizer, t.dim)
        for key, (c0, c1, vector) in entries.items():
            value = tensors.get(key)
            want = (t.num_embeddings,) if vector else (t.num_embeddings, c1 - c0)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                got = (tuple(value.shape) if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ValueError(f"BagPipe table {table!r}: optimizer state {key!r} must "
                                 f"have shape {want}, got {got}")
        self.open_phase = True
        if not entries:
            return
        store = self._store(table, True)
        for key, (c0, _, vector) in entries.items():
            self._write(store, tensors[key], t.dim + c0, vector)

    def _write(self, store: _TableRows, value: torch.Tensor, col: int, vector: bool) -> None:
        """This rank's part of `value` into `store`'s rows, from column `col`."""
        width = 1 if vector else int(value.shape[1])
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                offsets = shard.metadata.shard_offsets
                sizes = shard.metadata.shard_sizes
                r0 = int(offsets[0])
                c0 = col + (0 if vector else int(offsets[1]))
                c1 = c0 + (1 if vector else int(sizes[1]))
                PSTensor(store, r0, r0 + int(sizes[0]), c0, c1,
                         drop_col=vector).copy_(shard.tensor)
            return
        start, stop = row_blocks(store.rows, self._job.world_size)[self._job.rank]
        if stop > start:
            PSTensor(store, start, stop, col, col + width,
                     drop_col=vector).copy_(value.detach()[start:stop])

    # ---- the end of a write phase --------------------------------------------------------------
    def settle(self) -> None:
        """Ends a write phase (a collective once a state dict was taken or a load began on
        every rank; nothing otherwise): every rank learns whether any rank wrote and, if so,
        drops its cached rows (invariant 2)."""
        if not self.open_phase:
            return
        flag = torch.tensor([1.0 if self.wrote else 0.0])
        self._job.control.all_reduce_sum_(flag)
        self.open_phase = False
        self.wrote = False
        if flag.item() > 0:
            for rt in self._runtimes:
                rt.invalidate()
        if self._on_settle is not None:
            self._on_settle()

