"""What a PS table is and how a store holds it: `TableSchema`, `StoreLayout`, `StoreSpec`,
`LoadSpec`.

Each spec is a frozen dataclass that states its fields, their defaults and their checks once
(a bad value raises TypeError / ValueError naming the field, as the caller spelled it) and
hands itself to the native component as that component's own struct (`native()`):

* `TableSchema` — a table's row width, the init of rows never written, its key bound and its
  optimizer (``C.TableSchema``; ``native_init()``: the ``C.InitSpec`` alone);
* `StoreLayout` — how a store holds its rows: hash shards, threads, memory budget, spill
  directory, watermarks, page rows (a ``C.StoreOptions`` without a table: what a PS shard
  gives every table it creates);
* `StoreSpec` — one `EmbeddingStore`: a `TableSchema` and a `StoreLayout` (``C.StoreOptions``);
* `LoadSpec` — `EmbeddingStore.load`: expectations of the checkpoint and overrides of its
  layout, None meaning "the checkpoint's" (``C.LoadOverrides``; `check` compares the
  expectations with a checkpoint's manifest).

No torch at import (module docstring of `optimizer_spec`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps._args import budget_arg, float_arg, int_arg, optional_path
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

__all__ = ["INIT_KINDS", "LoadSpec", "StoreLayout", "StoreSpec", "TableSchema"]

INIT_KINDS = ("uniform", "zeros", "constant")

# (start_key, bound) ranges of a fused table's uniform init: each key uses the last range
# starting at or below it.
BoundRanges = tuple[tuple[int, float], ...]


# ---- the checks of each field, stated once (TableSchema, StoreLayout and LoadSpec use them) ----
def _dim(value: Any) -> int:
    return int_arg(value, "dim", minimum=1)


def _init(value: Any) -> str:
    if value not in INIT_KINDS:
        raise ValueError(f"init must be one of {list(INIT_KINDS)}, got {value!r}")
    return str(value)


def _init_bound(value: Any) -> float | BoundRanges:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        bound = float_arg(value, "init_bound")
        if bound < 0:
            raise ValueError(f"init_bound must be >= 0, got {bound}")
        return bound
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise ValueError("init_bound: the list of (start_key, bound) ranges is empty")
        ranges: list[tuple[int, float]] = []
        for i, item in enumerate(value):
            if not (isinstance(item, Sequence) and len(item) == 2):
                raise TypeError(f"init_bound[{i}] must be a (start_key, bound) pair")
            start = int_arg(item[0], f"init_bound[{i}][0]")
            b = float_arg(item[1], f"init_bound[{i}][1]")
            if b < 0:
                raise ValueError(f"init_bound[{i}][1] must be >= 0, got {b}")
            ranges.append((start, b))
        if any(b[0] <= a[0] for a, b in itertools.pairwise(ranges)):
            raise ValueError("init_bound: range starts must be strictly increasing")
        return tuple(ranges)
    raise TypeError(
        "init_bound must be None, a float or a list of (start_key, bound) pairs, got "
        f"{type(value).__name__}"
    )


def _init_value(value: Any) -> float:
    return float_arg(value, "init_value")


def _seed(value: Any) -> int:
    seed = int_arg(value, "seed")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def _key_bound(value: Any) -> int:
    return int_arg(value, "key_bound", minimum=1)


def _num_shards(value: Any) -> int:
    return int_arg(value, "num_shards", minimum=1)


def _num_threads(value: Any) -> int:
    return int_arg(value, "num_threads", minimum=1)


def _memory_budget(value: Any) -> int | str:
    budget_arg(value)  # raises naming memory_budget
    return value


def _spill_dir(value: Any) -> str:
    return optional_path(value, "spill_dir")


def _high_watermark(value: Any) -> float:
    return float_arg(value, "high_watermark")


def _low_watermark(value: Any) -> float:
    return float_arg(value, "low_watermark")


def _page_rows(value: Any) -> int:
    return int_arg(value, "page_rows", minimum=1)


def _checked(spec: Any, checks: dict[str, Callable[[Any], Any]]) -> None:
    """Replaces each named field of a frozen spec by its checked value (None stays None)."""
    for name, check in checks.items():
        value = getattr(spec, name)
        if value is not None:
            object.__setattr__(spec, name, check(value))


_SCHEMA_CHECKS: dict[str, Callable[[Any], Any]] = {
    "dim": _dim,
    "key_bound": _key_bound,
    "init": _init,
    "seed": _seed,
    "init_value": _init_value,
}
_LAYOUT_CHECKS: dict[str, Callable[[Any], Any]] = {
    "num_shards": _num_shards,
    "num_threads": _num_threads,
    "memory_budget": _memory_budget,
    "spill_dir": _spill_dir,
    "high_watermark": _high_watermark,
    "low_watermark": _low_watermark,
    "page_rows": _page_rows,
}


# ---- a table -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TableSchema:
    """A PS table: its row width, how rows never written read, its key bound and the
    optimizer its rows' state belongs to (``C.TableSchema``, csrc/shard/table_backend.h).

    `init` is ``"uniform"`` (in ``[-init_bound, init_bound)``), ``"zeros"`` or
    ``"constant"`` (`init_value`); rows are a deterministic function of `seed`, the key and
    the column (csrc/store/init.h). `init_bound` is a float, a list of ``(start_key, bound)``
    ranges (a fused table: each key uses the last range starting at or below it), or None:
    ``sqrt(1 / key_bound)``. `key_bound`: keys lie in ``[0, key_bound)`` (None: any int64).
    `optimizer`: an `OptimizerSpec`, a kind name or a dict of its fields (held as the spec).
    """

    dim: int
    init: str = "uniform"
    init_bound: float | Sequence[tuple[int, float]] | None = None
    init_value: float = 0.0
    seed: int = 0
    key_bound: int | None = None
    optimizer: OptimizerSpec | str | dict[str, Any] = "sgd"

    def __post_init__(self) -> None:
        self._check_schema()

    def _check_schema(self) -> None:
        _checked(self, _SCHEMA_CHECKS)
        if self.init == "uniform":
            if self.init_bound is None:
                if self.key_bound is None:
                    raise ValueError(
                        "init_bound is required for init='uniform' without key_bound "
                        "(TorchRec's default is sqrt(1 / num_embeddings) of each table)"
                    )
            else:
                object.__setattr__(self, "init_bound", _init_bound(self.init_bound))
        object.__setattr__(self, "optimizer", OptimizerSpec.of(self.optimizer))

    def native_init(self) -> Any:
        """How never-written rows read (a ``C.InitSpec``)."""
        spec = C.InitSpec()
        spec.kind = self.init
        spec.value = self.init_value
        spec.seed = self.seed
        if self.init != "uniform":
            return spec
        bound = self.init_bound
        if bound is None:
            spec.bound = math.sqrt(1.0 / self.key_bound)  # type: ignore[operator]
        elif isinstance(bound, float):
            spec.bound = bound
        else:
            spec.bound_starts = [start for start, _ in bound]
            spec.bound_values = [b for _, b in bound]
        return spec

    def native(self) -> Any:
        """The table as a PS shard takes it (a ``C.TableSchema``)."""
        schema = C.TableSchema()
        self._fill_schema(schema)
        return schema

    def _fill_schema(self, target: Any) -> None:
        target.dim = self.dim
        target.init = self.native_init()
        target.key_bound = -1 if self.key_bound is None else self.key_bound
        target.optimizer = self.optimizer.native()  # type: ignore[union-attr]


# ---- a store's layout ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StoreLayout:
    """How a store holds its rows (csrc/store/embedding_store.h ``StoreOptions``).

    `num_shards` internal hash shards (a power of two), `num_threads` workers per batch op;
    `memory_budget` bytes of row pages (an int, ``"512M"``, ``"auto"``: half of the memory
    available; None: unlimited), above which pages spill to `spill_dir` (None: the store is
    memory-only and an op that would pass the budget raises MemoryError) between the
    watermarks; `page_rows` rows per arena page (None: about 2 MiB pages).
    """

    num_shards: int = 16
    num_threads: int = 1
    memory_budget: int | str | None = None
    spill_dir: str | os.PathLike[str] | None = None
    high_watermark: float = 0.8
    low_watermark: float = 0.6
    page_rows: int | None = None

    def __post_init__(self) -> None:
        self._check_layout()

    def _check_layout(self) -> None:
        _checked(self, _LAYOUT_CHECKS)

    @property
    def layout(self) -> StoreLayout:
        """The layout alone (a spec that extends it, e.g. `StoreSpec`, drops the rest)."""
        return StoreLayout(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(StoreLayout)})

    def native(self) -> Any:
        """The layout as a ``C.StoreOptions`` (dim, init, key bound and optimizer left at
        their defaults: a PS shard sets them per table)."""
        o = C.StoreOptions()
        self._fill_layout(o)
        return o

    def _fill_layout(self, o: Any) -> None:
        o.num_shards = self.num_shards
        o.num_threads = self.num_threads
        o.memory_budget = budget_arg(self.memory_budget)
        o.spill_dir = self.spill_dir or ""
        o.high_watermark = self.high_watermark
        o.low_watermark = self.low_watermark
        o.page_rows = 0 if self.page_rows is None else self.page_rows


# ---- one store ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StoreSpec(TableSchema, StoreLayout):
    """One `EmbeddingStore`: the table it holds (`TableSchema`'s fields) and how it holds it
    (`StoreLayout`'s fields), e.g. ``StoreSpec(dim=16, init="zeros", optimizer="adagrad",
    memory_budget="4G", spill_dir="/nvme")``."""

    def __post_init__(self) -> None:
        self._check_schema()
        self._check_layout()

    def native(self) -> Any:
        """The store's options (a ``C.StoreOptions``)."""
        o = C.StoreOptions()
        self._fill_layout(o)
        self._fill_schema(o)
        return o


# ---- loading a checkpoint ------------------------------------------------------------------
def _f32_bits(x: float) -> int:
    """The IEEE bits of x rounded to float32 (how the store keeps init parameters)."""
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """How `EmbeddingStore.load` opens a checkpoint; None: the checkpoint's.

    Expectations (a checkpoint that disagrees is refused, `check`): `dim`, `init`,
    `init_bound`, `init_value`, `seed`, and `optimizer` unless the load is weights-only
    (`weights_only`, or a weights-only checkpoint: then `optimizer` is the store's new
    optimizer and every row starts from its initial state). Overrides: `num_shards`,
    `page_rows`, `key_bound` (the layout) and `num_threads`, `memory_budget`, `spill_dir`, the
    watermarks (the runtime). Each field is checked as in `TableSchema` / `StoreLayout`.
    `chain_links`: of a chained checkpoint (`EmbeddingStore.checkpoint`), load only the base
    and its first ``chain_links - 1`` increments (an earlier complete point); None: all.
    """

    dim: int | None = None
    init: str | None = None
    init_bound: float | Sequence[tuple[int, float]] | None = None
    init_value: float | None = None
    seed: int | None = None
    optimizer: OptimizerSpec | str | dict[str, Any] | None = None
    num_shards: int | None = None
    num_threads: int | None = None
    key_bound: int | None = None
    memory_budget: int | str | None = None
    spill_dir: str | os.PathLike[str] | None = None
    high_watermark: float | None = None
    low_watermark: float | None = None
    page_rows: int | None = None
    weights_only: bool = False
    chain_links: int | None = None

    def __post_init__(self) -> None:
        _checked(self, {**_SCHEMA_CHECKS, "init_bound": _init_bound, **_LAYOUT_CHECKS})
        if self.chain_links is not None:
            object.__setattr__(self, "chain_links",
                               int_arg(self.chain_links, "chain_links", minimum=1))
        if self.optimizer is not None:
            object.__setattr__(self, "optimizer", OptimizerSpec.of(self.optimizer))
        object.__setattr__(self, "weights_only", bool(self.weights_only))

    def check(self, info: dict[str, Any], path: str) -> None:
        """Raises ValueError naming the first expectation the checkpoint at `path` (its
        manifest: `info`) does not meet. The optimizer is the native load's to compare."""
        if self.init is not None and self.init != info["init"]:
            raise ValueError(f"init: the checkpoint in {path} uses init={info['init']!r}, "
                             f"expected {self.init!r}")
        if self.seed is not None and self.seed != info["seed"]:
            raise ValueError(f"seed: the checkpoint in {path} uses seed={info['seed']}, got "
                             f"{self.seed}")
        if (self.init_value is not None and info["init"] == "constant"
                and _f32_bits(self.init_value) != _f32_bits(info["init_value"])):
            raise ValueError(f"init_value: the checkpoint in {path} uses {info['init_value']}, "
                             f"got {self.init_value}")
        if self.init_bound is not None and info["init"] == "uniform":
            want = TableSchema(dim=1, init_bound=self.init_bound,
                               key_bound=info["key_bound"] if info["key_bound"] > 0 else None
                               ).native_init()
            same = (
                list(want.bound_starts) == list(info["bound_starts"])
                and [_f32_bits(b) for b in want.bound_values]
                == [_f32_bits(b) for b in info["bound_values"]]
                and (want.bound_starts or _f32_bits(want.bound) == _f32_bits(info["init_bound"]))
            )
            if not same:
                raise ValueError(
                    f"init_bound: the checkpoint in {path} was written with a different bound"
                )

    def native(self) -> Any:
        """The overrides as the native load takes them (a ``C.LoadOverrides``)."""
        o = C.LoadOverrides()
        o.optimizer = None if self.optimizer is None else self.optimizer.native()  # type: ignore[union-attr]
        o.dim = self.dim
        o.num_shards = self.num_shards
        o.num_threads = self.num_threads
        o.key_bound = self.key_bound
        o.page_rows = self.page_rows
        o.memory_budget = None if self.memory_budget is None else budget_arg(self.memory_budget)
        o.spill_dir = self.spill_dir
        o.high_watermark = self.high_watermark
        o.low_watermark = self.low_watermark
        o.weights_only = self.weights_only
        o.chain_links = self.chain_links
        return o
