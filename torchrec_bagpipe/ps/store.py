"""Python face of the native storage engine (``csrc/store``).

`EmbeddingStore` holds fp32 rows of one dimension keyed by int64. Tensors cross into native
code zero-copy (``tensor.numpy()``); the GIL is released while the store works. Arguments are
checked here first so that errors name the argument the caller passed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps._args import (
    float_arg,
    int_arg,
    keys_arg,
    lr_arg,
    path_arg,
    rows_arg,
    tensor_arg,
)
from torchrec_bagpipe.ps.options import init_spec, load_overrides, store_options

__all__ = ["EmbeddingStore", "SpillWarning", "checkpoint_info", "initial_rows"]

SpillWarning = C.SpillWarning


def _f32(x: float) -> int:
    """The IEEE bits of x rounded to float32 (how the store keeps init parameters)."""
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified manifest of a checkpoint (dim, init, rows, meta, ...), without its data."""
    info = dict(C.store_checkpoint_info(path_arg(path, "path")))
    info["meta"] = dict(info["meta"])
    return info


def initial_rows(
    keys: torch.Tensor,
    dim: int,
    init: str = "uniform",
    init_bound: float | Sequence[tuple[int, float]] | None = None,
    init_value: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """The deterministic initial rows of `keys` (what a store returns for unwritten keys)."""
    k = keys_arg(keys)
    dim = int_arg(dim, "dim", minimum=1)
    spec = init_spec(init, init_bound, init_value, seed, None)
    out = torch.empty((k.shape[0], dim), dtype=torch.float32)
    C.store_initial_rows(k, out.numpy(), spec)
    return out


class EmbeddingStore:
    """fp32 rows of one dimension keyed by int64 (see docs/ARCHITECTURE.md §2).

    Every row that was never written reads as its deterministic initial value. All batch
    operations take 1-D contiguous int64 CPU key tensors and (n, dim) contiguous float32 CPU
    row tensors; a bad argument raises TypeError / ValueError naming it, before anything is
    written. Results are bitwise independent of ``num_threads`` and ``num_shards``.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_shards: int = 16,
        num_threads: int = 1,
        init: str = "uniform",
        init_bound: float | Sequence[tuple[int, float]] | None = None,
        init_value: float = 0.0,
        seed: int = 0,
        key_bound: int | None = None,
        memory_budget: int | str | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        high_watermark: float = 0.8,
        low_watermark: float = 0.6,
        page_rows: int | None = None,
    ) -> None:
        options = store_options(
            dim,
            num_shards=num_shards,
            num_threads=num_threads,
            init=init,
            init_bound=init_bound,
            init_value=init_value,
            seed=seed,
            key_bound=key_bound,
            memory_budget=memory_budget,
            spill_dir=spill_dir,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            page_rows=page_rows,
        )
        self._open(options)

    @classmethod
    def from_options(cls, options: Any) -> EmbeddingStore:
        """A store built from a ``C.StoreOptions`` (`torchrec_bagpipe.ps.options.store_options`)."""
        store = cls.__new__(cls)
        store._open(options)
        return store

    def _open(self, options: Any) -> None:
        self._core = C.StoreCore(options)
        self._dim = int(options.dim)
        self.meta: dict[str, str] = {}

    # ---- properties ---------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self._dim

    def options(self) -> dict[str, Any]:
        """The resolved construction options (an automatic budget shows as bytes)."""
        return dict(self._core.options())

    def __len__(self) -> int:
        return int(self._core.size())

    def __repr__(self) -> str:
        o = self._core.options()
        return (
            f"EmbeddingStore(dim={self._dim}, rows={len(self)}, num_shards={o['num_shards']}, "
            f"num_threads={o['num_threads']}, init={o['init']!r})"
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
        n = k.shape[0]
        if out is None:
            out = torch.empty((n, self._dim), dtype=torch.float32)
        o = tensor_arg(out, "out", torch.float32)
        if o.dim() != 2 or o.shape[0] != n or o.shape[1] != self._dim:
            raise ValueError(f"out must have shape ({n}, {self._dim}), got {tuple(o.shape)}")
        if o.requires_grad:
            raise ValueError("out must not require grad")
        self._core.lookup(k, o.numpy(), bool(insert_missing))
        return out

    def assign(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Sets the rows of `keys`; for duplicate keys the last occurrence wins."""
        k = keys_arg(keys)
        self._core.assign(k, rows_arg(rows, "rows", k.shape[0], self._dim))

    def apply_sgd(
        self, keys: torch.Tensor, grads: torch.Tensor, lr: float, grad_divisor: int = 1
    ) -> None:
        """One SGD step per distinct key: ``w -= lr * (sum of its grads in input order) / d``.
        REQUIRES: lr finite and > 0 (ValueError naming it)."""
        k = keys_arg(keys)
        g = rows_arg(grads, "grads", k.shape[0], self._dim)
        lr = lr_arg(lr, "lr")
        grad_divisor = int_arg(grad_divisor, "grad_divisor", minimum=1)
        if grad_divisor > 2**31 - 1:
            raise ValueError(f"grad_divisor must be < 2**31, got {grad_divisor}")
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

    def export(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yields (keys, rows) chunks of every stored row, in a deterministic order.

        The store must not change while the iterator is consumed (ValueError otherwise).
        """
        chunk_rows = int_arg(chunk_rows, "chunk_rows", minimum=1)
        cursor = 0
        while cursor != -1:
            keys = torch.empty(chunk_rows, dtype=torch.int64)
            rows = torch.empty((chunk_rows, self._dim), dtype=torch.float32)
            n, cursor = self._core.export_chunk(cursor, keys.numpy(), rows.numpy())
            if n:
                yield keys[:n], rows[:n]

    def stats(self) -> dict[str, int]:
        """rows, bytes_resident, bytes_maps, bytes_spilled, pages, pages_spilled, page_bytes,
        spill_count, swap_outs, swap_ins, lookups, updates, memory_budget."""
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
        ``weights_only=True`` writes an inference export without optimizer state.
        """
        path = path_arg(path, "path")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict of str to str, got {type(meta).__name__}")
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(
                    f"meta must map str to str, got {type(k).__name__} -> {type(v).__name__}"
                )
        self._core.save(path, meta, bool(weights_only))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        dim: int | None = None,
        init: str | None = None,
        init_bound: float | Sequence[tuple[int, float]] | None = None,
        init_value: float | None = None,
        seed: int | None = None,
        num_shards: int | None = None,
        num_threads: int | None = None,
        key_bound: int | None = None,
        memory_budget: int | str | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        high_watermark: float | None = None,
        low_watermark: float | None = None,
        page_rows: int | None = None,
        weights_only: bool = False,
    ) -> EmbeddingStore:
        """Opens a checkpoint written by `save`.

        `dim`, `init`, `init_bound`, `init_value` and `seed`, when given, are expectations: a
        checkpoint that disagrees is refused with a ValueError naming the field. The other
        arguments override the checkpoint's layout (shards, page rows, key bound) or set the
        runtime options (threads, budget, spill). A torn, corrupt or unknown-version
        checkpoint raises ValueError.
        """
        path = path_arg(path, "path")
        info = checkpoint_info(path)
        if dim is not None:
            int_arg(dim, "dim", minimum=1)
        if init is not None and init != info["init"]:
            raise ValueError(
                f"init: the checkpoint in {path} uses init={info['init']!r}, expected {init!r}"
            )
        if seed is not None and int_arg(seed, "seed") != info["seed"]:
            raise ValueError(f"seed: the checkpoint in {path} uses seed={info['seed']}, got {seed}")
        if (
            init_value is not None
            and info["init"] == "constant"
            and _f32(float_arg(init_value, "init_value")) != _f32(info["init_value"])
        ):
            raise ValueError(
                f"init_value: the checkpoint in {path} uses {info['init_value']}, got {init_value}"
            )
        if init_bound is not None and info["init"] == "uniform":
            want = init_spec(
                "uniform", init_bound, 0.0, 0, info["key_bound"] if info["key_bound"] > 0 else None
            )
            same = (
                list(want.bound_starts) == list(info["bound_starts"])
                and [_f32(b) for b in want.bound_values] == [_f32(b) for b in info["bound_values"]]
                and (want.bound_starts or _f32(want.bound) == _f32(info["init_bound"]))
            )
            if not same:
                raise ValueError(
                    f"init_bound: the checkpoint in {path} was written with a different bound"
                )
        overrides = load_overrides(
            dim=dim,
            num_shards=num_shards,
            num_threads=num_threads,
            key_bound=key_bound,
            memory_budget=memory_budget,
            spill_dir=spill_dir,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            page_rows=page_rows,
            weights_only=weights_only,
        )
        core, meta = C.store_load(path, overrides)
        store = cls.__new__(cls)
        store._core = core
        store._dim = int(core.options()["dim"])
        store.meta = dict(meta)
        return store

    @staticmethod
    def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The verified manifest of a checkpoint (dim, init, rows, meta, ...), without its data."""
        return checkpoint_info(path)

    # ---- initial values -----------------------------------------------------------------------
    @staticmethod
    def initial_rows(
        keys: torch.Tensor,
        dim: int,
        init: str = "uniform",
        init_bound: float | Sequence[tuple[int, float]] | None = None,
        init_value: float = 0.0,
        seed: int = 0,
    ) -> torch.Tensor:
        """The deterministic initial value of each key's row (see csrc/store/init.h)."""
        return initial_rows(keys, dim, init, init_bound, init_value, seed)
