"""PS-backed tensors: the live state-dict tensors of BagPipe tables and their optimizer state.

A BagPipe table's rows live in the PS, and a table may be far larger than a trainer's
memory. Its state-dict entry is therefore no copy: it is a TorchRec-style row-wise
`ShardedTensor` (`row_wise_sharded`) whose local shards are `PSTensor`s, tensors that hold
no data and stand for a block of rows (and a column range) of a `RowStore`:

* reading one (any op that needs values: `clone`, `torch.save`, arithmetic, comparisons, a
  `copy_` out of it) reads its rows from the PS, in requests of at most the store's
  `chunk_rows` rows;
* writing one (`copy_` into it, or any in-place op) writes its rows back, after the store
  drained the pending commits; a write of part of a row's columns reads the row first;
* `detach`, `alias`, `narrow` / `slice` (step 1, rows or columns) and `select` of a row are
  views of the same store: a write through them is a write to the table (what DCP's load
  and TorchRec's in-place loading do); other view ops (`view`, `reshape`, `t`, ...) return
  a copy.

Row-wise, as TorchRec's RW sharding: rank r owns the rows
`[r * ceil(N / W), (r + 1) * ceil(N / W))` (clipped to N), held as consecutive local shards
of at most `chunk_rows` rows each, so DCP (one write item per local shard) and every other
consumer of the shards handle a bounded block at a time; DCP reshards on load by the
shards' offsets, so a checkpoint restores at any world size.

Thread-safety: the rank's training thread (the store's rules).

Invariants:
1. No read or write of a `PSTensor` asks its store for more than `chunk_rows` rows at once;
   only an op that needs a whole view's values at once (a `clone`, arithmetic) holds that
   view's rows in memory, and a local shard has at most `chunk_rows` rows.
2. A `PSTensor` never caches values: every read sees the store as it is then.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.utils._pytree import tree_map

__all__ = ["PSTensor", "RowStore", "ViewStats", "row_blocks", "row_wise_sharded", "view_stats"]

_aten = torch.ops.aten


@dataclass
class ViewStats:
    """This process's `PSTensor` accounting: the most rows one read held at once (a chunk
    streamed, or a whole view materialised) since the last `reset`."""

    peak_rows: int = 0

    def note(self, rows: int) -> None:
        self.peak_rows = max(self.peak_rows, rows)

    def reset(self) -> None:
        self.peak_rows = 0


_STATS = ViewStats()


def view_stats() -> ViewStats:
    """The process's `ViewStats` (tests bound the memory a state-dict path holds with it)."""
    return _STATS


class RowStore(Protocol):
    """Rows of `width` float32 columns, `[0, rows)`, read and written by range."""

    rows: int
    width: int
    chunk_rows: int

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as a [stop - start, width] float32 CPU tensor.
        REQUIRES: stop - start <= chunk_rows."""
        ...

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Writes `rows` ([n, width] float32 CPU, n <= chunk_rows) as rows [start, start + n)."""
        ...


class PSTensor(torch.Tensor):
    """Rows [r0, r1) x columns [c0, c1) of a `RowStore`, as a float32 CPU tensor holding no
    data (module docstring). `drop_row` / `drop_col`: the row (a `select`) or the column
    axis (a 1-D store: row-wise Adagrad's state) is not a dimension of the tensor."""

    _store: RowStore
    _r0: int
    _r1: int
    _c0: int
    _c1: int
    _drop_row: bool
    _drop_col: bool

    # Plain tensors out of torch functions (the dispatch below decides what stays a view).
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, store: RowStore, r0: int, r1: int, c0: int, c1: int, *,
                drop_row: bool = False, drop_col: bool = False) -> PSTensor:
        shape = ([] if drop_row else [r1 - r0]) + ([] if drop_col else [c1 - c0])
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=torch.float32, device=torch.device("cpu"), requires_grad=False)
        t._store = store
        t._r0, t._r1, t._c0, t._c1 = r0, r1, c0, c1
        t._drop_row, t._drop_col = drop_row, drop_col
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"PSTensor(rows [{self._r0}, {self._r1}), columns [{self._c0}, {self._c1}), "
                f"shape {tuple(self.shape)})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (torch.save, DCP's writer) as its values: a plain tensor.
        return self.materialize().__reduce_ex__(protocol)

    # ---- values ---------------------------------------------------------------------------------
    def _axes(self) -> list[str]:
        return ([] if self._drop_row else ["row"]) + ([] if self._drop_col else ["col"])

    def _read_block(self, lo: int, hi: int) -> torch.Tensor:
        """Store rows [r0 + lo, r0 + hi) restricted to the columns, as [hi - lo, c1 - c0]."""
        rows = self._store.read(self._r0 + lo, self._r0 + hi)
        _STATS.note(hi - lo)
        return rows[:, self._c0:self._c1]

    def materialize(self) -> torch.Tensor:
        """The values now, as a plain tensor of this shape (read in bounded chunks)."""
        n = self._r1 - self._r0
        _STATS.note(n)
        out = torch.empty(n, self._c1 - self._c0, dtype=torch.float32)
        for lo in range(0, n, self._store.chunk_rows):
            hi = min(n, lo + self._store.chunk_rows)
            out[lo:hi] = self._read_block(lo, hi)
        return out.reshape(self.shape)

    def _write_from(self, src: torch.Tensor | PSTensor) -> None:
        """Writes `src` (broadcastable to this shape) into the store, chunk by chunk."""
        if isinstance(src, PSTensor) and src._same_place(self):
            return  # the very rows: nothing changes
        n = self._r1 - self._r0
        width = self._c1 - self._c0
        full = self._c0 == 0 and self._c1 == self._store.width
        plain = None if isinstance(src, PSTensor) else src.detach().expand(self.shape)
        for lo in range(0, n, self._store.chunk_rows):
            hi = min(n, lo + self._store.chunk_rows)
            if plain is not None:
                block = plain if self._drop_row else plain[lo:hi]
            else:
                assert isinstance(src, PSTensor)
                block = src._rows_for(lo, hi, self)
            block = block.reshape(hi - lo, width).to(torch.float32)
            if full:
                rows = block.contiguous()
            else:
                rows = self._store.read(self._r0 + lo, self._r0 + hi).clone()
                _STATS.note(hi - lo)
                rows[:, self._c0:self._c1] = block
            self._store.write(self._r0 + lo, rows)

    def _rows_for(self, lo: int, hi: int, dst: PSTensor) -> torch.Tensor:
        """Rows [lo, hi) of this tensor's values as `dst` would take them (same shape)."""
        if tuple(self.shape) != tuple(dst.shape):
            return self.materialize().expand(dst.shape)[lo:hi]
        return self._read_block(lo, hi)

    def _same_place(self, other: PSTensor) -> bool:
        return (self._store is other._store and
                (self._r0, self._r1, self._c0, self._c1, self._drop_row, self._drop_col) ==
                (other._r0, other._r1, other._c0, other._c1, other._drop_row,
                 other._drop_col))

    # ---- views ------------------------------------------------------------------------------
    def _view(self, r0: int, r1: int, c0: int, c1: int, drop_row: bool) -> PSTensor:
        return PSTensor(self._store, r0, r1, c0, c1, drop_row=drop_row,
                        drop_col=self._drop_col)

    def _slice(self, dim: int, start: int | None, end: int | None, step: int) -> PSTensor | None:
        axes = self._axes()
        dim = dim + len(axes) if dim < 0 else dim
        if step != 1 or not 0 <= dim < len(axes):
            return None
        axis = axes[dim]
        lo, hi = (self._r0, self._r1) if axis == "row" else (self._c0, self._c1)
        size = hi - lo
        a, b, _ = slice(start, end).indices(size)
        b = max(a, b)
        if axis == "row":
            return self._view(lo + a, lo + b, self._c0, self._c1, False)
        return self._view(self._r0, self._r1, lo + a, lo + b, self._drop_row)

    def _select(self, dim: int, index: int) -> PSTensor | None:
        axes = self._axes()
        dim = dim + len(axes) if dim < 0 else dim
        if not 0 <= dim < len(axes) or axes[dim] != "row":
            return None
        n = self._r1 - self._r0
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of bounds for dimension 0 with size {n}")
        index = index + n if index < 0 else index
        return self._view(self._r0 + index, self._r0 + index + 1, self._c0, self._c1, True)

    # ---- dispatch -----------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):
            t = args[0]
            return t._view(t._r0, t._r1, t._c0, t._c1, t._drop_row)
        if func is _aten.slice.Tensor:
            t, dim, start, end, step = _with_defaults(args, kwargs, (0, None, None, 1))
            view = t._slice(dim, start, end, step)
            if view is not None:
                return view
        if func is _aten.select.int:
            view = args[0]._select(args[1], args[2])
            if view is not None:
                return view
        if func is _aten.is_pinned.default:
            return False
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, PSTensor):
                dst._write_from(src)
                return dst
            if isinstance(src, PSTensor) and tuple(src.shape) == tuple(dst.shape) \
                    and not src._drop_row and dst.dim() > 0:
                for lo in range(0, src._r1 - src._r0, src._store.chunk_rows):
                    hi = min(src._r1 - src._r0, lo + src._store.chunk_rows)
                    dst[lo:hi].copy_(src._read_block(lo, hi).reshape(dst[lo:hi].shape))
                return dst
        # Everything else runs on the values; an in-place op writes them back.
        plain_args = tree_map(_plain, args)
        plain_kwargs = tree_map(_plain, kwargs)
        out = func(*plain_args, **plain_kwargs)
        mutated = _mutated_args(func)
        for i in mutated:
            if i < len(args) and isinstance(args[i], PSTensor):
                args[i]._write_from(plain_args[i])
        if mutated and args and isinstance(args[0], PSTensor) and out is plain_args[0]:
            return args[0]
        return out


def _with_defaults(args: Sequence[Any], kwargs: dict[str, Any],
                   defaults: tuple[Any, ...]) -> list[Any]:
    """`slice.Tensor`'s (self, dim, start, end, step), positional or keyword."""
    names = ("dim", "start", "end", "step")
    out = [args[0]]
    for i, (name, default) in enumerate(zip(names, defaults)):
        out.append(args[i + 1] if len(args) > i + 1 else kwargs.get(name, default))
    return out


def _plain(x: Any) -> Any:
    return x.materialize() if isinstance(x, PSTensor) else x


def _mutated_args(func: Any) -> list[int]:
    """Positions of the arguments `func` writes in place."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            out.append(i)
    return out


# ---- row-wise sharded tensors --------------------------------------------------------------------
def row_blocks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's rows [start, stop) under TorchRec's row-wise sharding: blocks of
    ceil(rows / world_size), the last ones shorter or empty."""
    block = max(1, math.ceil(rows / world_size))
    return [(min(r * block, rows), min((r + 1) * block, rows)) for r in range(world_size)]


def row_wise_sharded(
    make: Callable[[int, int], torch.Tensor],
    size: Sequence[int],
    chunk_rows: int,
    *,
    group: dist.ProcessGroup,
) -> ShardedTensor:
    """A row-wise `ShardedTensor` of global `size` ([rows] or [rows, cols]) over `group`:
    rank r's rows (`row_blocks`) as consecutive local shards of at most `chunk_rows` rows,
    shard [start, stop) being `make(start, stop)` (a tensor of that block's shape). Builds
    the global metadata locally (no collective)."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    rows = int(size[0])
    tail = [int(s) for s in size[1:]]
    shards_md: list[ShardMetadata] = []
    local: list[Shard] = []
    for r, (start, stop) in enumerate(row_blocks(rows, world)):
        for lo in range(start, stop, chunk_rows):
            hi = min(stop, lo + chunk_rows)
            md = ShardMetadata(shard_offsets=[lo] + [0] * len(tail),
                               shard_sizes=[hi - lo, *tail], placement=f"rank:{r}/cpu")
            shards_md.append(md)
            if r == rank:
                local.append(Shard(make(lo, hi), md))
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_md, size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=torch.float32, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=group)
