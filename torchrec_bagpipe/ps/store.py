"""Python face of the native storage engine (``csrc/store``).

`EmbeddingStore` holds fp32 rows of one dimension keyed by int64, each with the state of the
store's optimizer (`OptimizerSpec`). Tensors cross into native code zero-copy
(``tensor.numpy()``); the GIL is released while the store works. Arguments are checked here
first so that errors name the argument the caller passed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps._args import float_arg, int_arg, path_arg, spec_arg, step_lr_arg
from torchrec_bagpipe.ps._tensor_args import keys_arg, out_arg, rows_arg
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.ps.table_specs import LoadSpec, StoreSpec, TableSchema

__all__ = [
    "EmbeddingStore",
    "OptimizerSpec",
    "SpillWarning",
    "checkpoint_info",
    "initial_rows",
    "initial_state",
]

SpillWarning = C.SpillWarning


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified manifest of a checkpoint (dim, init, rows, meta, optimizer (its kind),
    optimizer_spec (an OptimizerSpec), state_dim, contents, chain (its links, base first:
    link, step, rows, bytes, meta; increments also parent, deletions, total_rows), ...),
    without its data."""
    info = dict(C.store_checkpoint_info(path_arg(path, "path")))
    info["meta"] = dict(info["meta"])
    info["chain"] = [{**dict(link), "meta": dict(link["meta"])} for link in info["chain"]]
    info["optimizer_spec"] = OptimizerSpec.from_native(dict(info["optimizer_spec"]))
    return info


def initial_rows(keys: torch.Tensor, schema: TableSchema | None = None, /,
                 **fields: Any) -> torch.Tensor:
    """The deterministic initial rows of `keys` (what a store returns for unwritten keys)
    under the init of `schema` (a `TableSchema`, or its fields as keywords: dim, init,
    init_bound, init_value, seed, key_bound)."""
    k = keys_arg(keys)
    spec = spec_arg(TableSchema, schema, fields, "initial_rows")
    out = torch.empty((k.shape[0], spec.dim), dtype=torch.float32)
    C.store_initial_rows(k, out.numpy(), spec.native_init())
    return out


def initial_state(
    num_rows: int, dim: int, optimizer: OptimizerSpec | str | dict[str, Any] = "sgd"
) -> torch.Tensor:
    """The optimizer state of `num_rows` fresh rows, (num_rows, state_dim) float32 (what a
    store returns for unwritten keys; the same for every key)."""
    num_rows = int_arg(num_rows, "num_rows", minimum=0)
    dim = int_arg(dim, "dim", minimum=1)
    spec = OptimizerSpec.of(optimizer)
    out = torch.empty((num_rows, spec.state_dim(dim)), dtype=torch.float32)
    C.store_initial_state(out.numpy(), dim, spec.native())
    return out


def _meta_arg(meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict of str to str, got {type(meta).__name__}")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                f"meta must map str to str, got {type(k).__name__} -> {type(v).__name__}"
            )
    return meta


def _step_args(lr: Any, grad_divisor: Any) -> tuple[float, int]:
    lr = step_lr_arg(lr, "lr")
    grad_divisor = int_arg(grad_divisor, "grad_divisor", minimum=1)
    if grad_divisor > 2**31 - 1:
        raise ValueError(f"grad_divisor must be < 2**31, got {grad_divisor}")
    return lr, grad_divisor


def _chain_args(step: int, meta: Any, incremental: bool, full_every: int,
                chain_fraction: float) -> tuple[Any, ...]:
    step = int_arg(step, "step", minimum=-1)
    full_every = int_arg(full_every, "full_every", minimum=1)
    fraction = float_arg(chain_fraction, "chain_fraction")
    if not fraction > 0:
        raise ValueError(f"chain_fraction must be > 0, got {chain_fraction}")
    return step, _meta_arg(meta), bool(incremental), full_every, fraction


class PendingCheckpoint:
    """A store's chained checkpoint between `EmbeddingStore.begin_checkpoint` and its
    ``write()``: it holds the snapshot of its step (and keeps its store alive)."""

    def __init__(self, core: Any) -> None:
        self._core = core

    @property
    def step(self) -> int:
        return int(self._core.step)

    @property
    def incremental(self) -> bool:
        """An increment (False: a full base)."""
        return bool(self._core.incremental)

    def write(self) -> dict[str, Any]:
        """Writes and commits the snapshot (GIL released); returns what `checkpoint`
        returns. Once only (ValueError after)."""
        return dict(self._core.write())

    def drop(self) -> None:
        """Gives the snapshot up unwritten (the next checkpoint takes its changes)."""
        self._core.drop()


class EmbeddingStore:
    """fp32 rows of one dimension keyed by int64, each with the state of the store's optimizer
    (see docs/ARCHITECTURE.md §2).

    Every row that was never written reads as its deterministic initial value and initial
    state. All batch operations take 1-D contiguous int64 CPU key tensors and (n, dim)
    contiguous float32 CPU row tensors (state: (n, state_dim)); a bad argument raises
    TypeError / ValueError naming it, before anything is written. Results are bitwise
    independent of ``num_threads`` and ``num_shards``.
    """

    def __init__(self, spec: StoreSpec | None = None, /, **fields: Any) -> None:
        """A store of `spec` (a `StoreSpec`), or of `StoreSpec`'s fields given as keywords
        (``EmbeddingStore(dim=16, optimizer="adagrad")``; with `spec` they replace its
        fields)."""
        spec = spec_arg(StoreSpec, spec, fields, "EmbeddingStore")
        self._adopt(C.StoreCore(spec.native()), {})

    def _adopt(self, core: Any, meta: dict[str, str]) -> None:
        self._core = core
        resolved = core.options()
        self._dim = int(resolved["dim"])
        self._optimizer = OptimizerSpec.from_native(dict(resolved["optimizer"]))
        self._state_dim = int(core.state_dim())
        self.meta: dict[str, str] = dict(meta)

    # ---- properties ---------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self._dim

    @property
    def optimizer(self) -> OptimizerSpec:
        return self._optimizer

    @property
    def state_dim(self) -> int:
        """Optimizer state floats per row (0 for SGD)."""
        return self._state_dim

    def options(self) -> dict[str, Any]:
        """The resolved construction options (an automatic budget shows as bytes; the
        optimizer as an OptimizerSpec)."""
        options = dict(self._core.options())
        options["optimizer"] = OptimizerSpec.from_native(dict(options["optimizer"]))
        return options

    def __len__(self) -> int:
        return int(self._core.size())

    def __repr__(self) -> str:
        o = self._core.options()
        return (
            f"EmbeddingStore(dim={self._dim}, rows={len(self)}, num_shards={o['num_shards']}, "
            f"num_threads={o['num_threads']}, init={o['init']!r}, "
            f"optimizer={self._optimizer.kind!r})"
        )

    # ---- batch operations -----------------------------------------------------------------
    def lookup(
        self, keys: torch.Tensor, out: torch.Tensor | None = None, insert_missing: bool = True
    ) -> torch.Tensor:
        """Rows of `keys` (duplicates allowed) into `out` (allocated when None).

        ``insert_missing=False`` is a pure read: absent rows read as their initial value and
        are not stored.
        """
        k = keys_arg(keys)
        o = out_arg(out, "out", k.shape[0], self._dim)
        self._core.lookup(k, o.numpy(), bool(insert_missing))
        return o

    def lookup_with_state(
        self,
        keys: torch.Tensor,
        out: torch.Tensor | None = None,
        state_out: torch.Tensor | None = None,
        insert_missing: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`lookup` that also returns each row's optimizer state, (n, state_dim) into
        `state_out` (allocated when None). Absent rows read as their initial state."""
        k = keys_arg(keys)
        n = k.shape[0]
        o = out_arg(out, "out", n, self._dim)
        so = out_arg(state_out, "state_out", n, self._state_dim)
        self._core.lookup(k, o.numpy(), bool(insert_missing), so.numpy())
        return o, so

    def assign(
        self, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None = None
    ) -> None:
        """Sets the rows of `keys` and, with `state` ((n, state_dim)), their optimizer state;
        for duplicate keys the last occurrence wins. Without `state`, stored rows keep their
        state and new rows start from the initial state."""
        k = keys_arg(keys)
        n = k.shape[0]
        r = rows_arg(rows, "rows", n, self._dim)
        st = None if state is None else rows_arg(state, "state", n, self._state_dim)
        self._core.assign(k, r, st)

    def apply_gradients(
        self, keys: torch.Tensor, grads: torch.Tensor, lr: float, grad_divisor: int = 1
    ) -> None:
        """One update per distinct key with the store's optimizer, applied to the sum of its
        gradient rows in input order divided by `grad_divisor` (the arithmetic contract of
        csrc/store/embedding_store.h). For Adam, `lr` is the bias-corrected step size
        (`torchrec_bagpipe.ps.optimizer_spec.adam_step_size`)."""
        k = keys_arg(keys)
        g = rows_arg(grads, "grads", k.shape[0], self._dim)
        lr, grad_divisor = _step_args(lr, grad_divisor)
        self._core.apply_gradients(k, g, lr, grad_divisor)

    def apply_sgd(
        self, keys: torch.Tensor, grads: torch.Tensor, lr: float, grad_divisor: int = 1
    ) -> None:
        """One SGD step per distinct key: ``w -= lr * (sum of its grads in input order) / d``
        (with weight decay when the spec has it). Only for SGD stores (ValueError naming
        `optimizer` otherwise); `apply_gradients` serves every optimizer."""
        if self._optimizer.kind != "sgd":
            raise ValueError(
                f"optimizer: apply_sgd needs an SGD store, this one runs "
                f"{self._optimizer.kind!r} (use apply_gradients)"
            )
        k = keys_arg(keys)
        g = rows_arg(grads, "grads", k.shape[0], self._dim)
        lr, grad_divisor = _step_args(lr, grad_divisor)
        self._core.apply_sgd(k, g, lr, grad_divisor)

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """A bool tensor: whether each key is stored."""
        k = keys_arg(keys)
        out = torch.empty(k.shape[0], dtype=torch.uint8)
        self._core.contains(k, out.numpy())
        return out.view(torch.bool)

    def erase(self, keys: torch.Tensor) -> int:
        """Removes the present keys; returns how many distinct keys were removed."""
        return int(self._core.erase(keys_arg(keys)))

    def reserve(self, n: int) -> None:
        """Prepares key-map capacity for `n` rows in total (outside the hot path)."""
        self._core.reserve(int_arg(n, "n", minimum=0))

    def export(
        self, chunk_rows: int = 65536, *, with_state: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yields (keys, rows) chunks of every stored row, in a deterministic order;
        ``with_state=True``: (keys, rows, state) chunks.

        The store must not change while the iterator is consumed (ValueError otherwise).
        """
        chunk_rows = int_arg(chunk_rows, "chunk_rows", minimum=1)
        with_state = bool(with_state)
        cursor = 0
        while cursor != -1:
            keys = torch.empty(chunk_rows, dtype=torch.int64)
            rows = torch.empty((chunk_rows, self._dim), dtype=torch.float32)
            state = torch.empty((chunk_rows, self._state_dim), dtype=torch.float32)
            n, cursor = self._core.export_chunk(
                cursor, keys.numpy(), rows.numpy(), state.numpy() if with_state else None
            )
            if n:
                yield (keys[:n], rows[:n], state[:n]) if with_state else (keys[:n], rows[:n])

    def stats(self) -> dict[str, int]:
        """rows, bytes_resident, bytes_maps, bytes_spilled, pages, pages_spilled, page_bytes,
        spill_count, swap_outs, swap_ins, lookups, updates, memory_budget, state_dim,
        slot_bytes (arena bytes of one row: weights and optimizer state, with padding),
        dirty_rows (rows changed since the last `checkpoint`)."""
        return dict(self._core.stats())

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike[str],
        meta: dict[str, str] | None = None,
        weights_only: bool = False,
    ) -> None:
        """Crash-safe checkpoint into directory `path` (replaced atomically when it holds one).

        `meta` (str -> str) is stored in the manifest and returned by `load` as ``store.meta``.
        The manifest records the optimizer spec; ``weights_only=True`` leaves the optimizer
        state out (an inference export: loading it gives every row the initial state).
        """
        self._core.save(path_arg(path, "path"), _meta_arg(meta), bool(weights_only))

    def checkpoint(
        self,
        path: str | os.PathLike[str],
        step: int,
        meta: dict[str, str] | None = None,
        *,
        incremental: bool = True,
        full_every: int = 8,
        chain_fraction: float = 0.5,
    ) -> dict[str, Any]:
        """Chained checkpoint into directory `path` at `step` (Check-N-Run style; see
        csrc/store/embedding_store_incremental.cc): with `incremental`, only the rows stored or
        changed (with their optimizer state) and the keys erased since this store's previous
        `checkpoint` into `path`, linked to the chain there; a full base (which compacts the
        chain away) the first time, after `full_every` increments, once the increments would
        pass `chain_fraction` of the base's bytes, or when `path` holds another checkpoint.
        Crash-safe as `save`. `load` gives back the last link, bitwise.

        Returns what was written: incremental, links (of the chain now), rows, deletions,
        bytes (data bytes written), base_bytes, chain_bytes.
        """
        return dict(self._core.checkpoint(path_arg(path, "path"), *_chain_args(
            step, meta, incremental, full_every, chain_fraction)))

    def begin_checkpoint(
        self,
        path: str | os.PathLike[str],
        step: int,
        meta: dict[str, str] | None = None,
        *,
        incremental: bool = True,
        full_every: int = 8,
        chain_fraction: float = 0.5,
    ) -> PendingCheckpoint:
        """`checkpoint` in two halves (csrc/store/embedding_store_snapshot.cc): this call
        decides base or increment, checks `path` and takes a copy-on-write snapshot of the
        store as it is now (no row is copied yet); the returned `PendingCheckpoint`'s
        ``write()`` writes exactly that snapshot, from any thread, while this store keeps
        serving every call. One pending checkpoint per store at a time (ValueError); one
        dropped (``drop()``, or garbage-collected) unwritten, or whose write failed, loses
        nothing: an increment's changes go into the next checkpoint."""
        return PendingCheckpoint(self._core.begin_checkpoint(path_arg(path, "path"), *_chain_args(
            step, meta, incremental, full_every, chain_fraction)))

    @classmethod
    def load(cls, path: str | os.PathLike[str], spec: LoadSpec | None = None, /,
             **fields: Any) -> EmbeddingStore:
        """Opens a checkpoint written by `save` (this or an older format version), as `spec`
        says (a `LoadSpec`, or its fields as keywords; nothing: as saved).

        `dim`, `init`, `init_bound`, `init_value` and `seed`, when given, are expectations: a
        checkpoint that disagrees is refused with a ValueError naming the field. So is
        `optimizer` (naming the first differing field, e.g. ``optimizer.eps``), unless the
        load is weights-only (``weights_only=True`` or a weights-only checkpoint): then it
        may change the optimizer and every row starts from the initial state. Unset, the
        store runs the checkpoint's optimizer. The other fields override the checkpoint's
        layout (shards, page rows, key bound) or set the runtime options (threads, budget,
        spill). A torn, corrupt or unknown-version checkpoint raises ValueError.
        """
        path = path_arg(path, "path")
        info = checkpoint_info(path)
        load = spec_arg(LoadSpec, spec, fields, "EmbeddingStore.load")
        load.check(info, path)
        core, meta = C.store_load(path, load.native())
        store = cls.__new__(cls)
        store._adopt(core, meta)
        return store

    @staticmethod
    def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The verified manifest of a checkpoint (dim, init, rows, meta, ...), without its data."""
        return checkpoint_info(path)

    # ---- initial values -----------------------------------------------------------------------
    @staticmethod
    def initial_rows(keys: torch.Tensor, schema: TableSchema | None = None, /,
                     **fields: Any) -> torch.Tensor:
        """The deterministic initial value of each key's row (see csrc/store/init.h) under
        `schema` (a `TableSchema` or its fields: `initial_rows`)."""
        return initial_rows(keys, schema, **fields)

    @staticmethod
    def initial_state(
        num_rows: int, dim: int, optimizer: OptimizerSpec | str | dict[str, Any] = "sgd"
    ) -> torch.Tensor:
        """The optimizer state of `num_rows` fresh rows, (num_rows, state_dim) float32."""
        return initial_state(num_rows, dim, optimizer)
