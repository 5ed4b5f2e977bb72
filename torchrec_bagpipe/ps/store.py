"""Python face of the native storage engine (``csrc/store``).

`EmbeddingStore` holds fp32 rows of one dimension keyed by int64, each with the state of the
store's optimizer (`OptimizerSpec`). Tensors cross into native code zero-copy
(``tensor.numpy()``); the GIL is released while the store works. Arguments are checked here
first so that errors name the argument the caller passed.
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.config import parse_memory_budget
from torchrec_bagpipe.ps.optimizers import OptimizerSpec

__all__ = [
    "EmbeddingStore",
    "OptimizerSpec",
    "SpillWarning",
    "checkpoint_info",
    "initial_rows",
    "initial_state",
]

SpillWarning = C.SpillWarning

_INIT_KINDS = ("uniform", "zeros", "constant")


# ---- argument checking ----------------------------------------------------------------------
def _int_arg(value: Any, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _float_arg(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


# These checks run on every batch op: each costs tens of nanoseconds (no device objects).
def _tensor_arg(t: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype {dtype}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if not t.is_cpu:
        raise TypeError(f"{name} must be a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise TypeError(f"{name} must be contiguous")
    return t


def _numpy(t: torch.Tensor) -> Any:
    """Zero-copy numpy view of a checked tensor."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


def _keys_arg(keys: Any, name: str = "keys") -> Any:
    keys = _tensor_arg(keys, name, torch.int64)
    if keys.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(keys.shape)}")
    return _numpy(keys)


def _rows_arg(rows: Any, name: str, n: int, dim: int) -> Any:
    rows = _tensor_arg(rows, name, torch.float32)
    if rows.dim() != 2 or rows.shape[0] != n or rows.shape[1] != dim:
        raise ValueError(f"{name} must have shape ({n}, {dim}), got {tuple(rows.shape)}")
    return _numpy(rows)


def _state_arg(state: Any, name: str, n: int, state_dim: int) -> Any:
    """None, or an (n, state_dim) float32 tensor as numpy (a store without state takes (n, 0))."""
    if state is None:
        return None
    return _rows_arg(state, name, n, state_dim)


def _out_arg(out: Any, name: str, n: int, cols: int) -> torch.Tensor:
    """A writable (n, cols) float32 output tensor; allocated when None."""
    if out is None:
        return torch.empty((n, cols), dtype=torch.float32)
    o = _tensor_arg(out, name, torch.float32)
    if o.dim() != 2 or o.shape[0] != n or o.shape[1] != cols:
        raise ValueError(f"{name} must have shape ({n}, {cols}), got {tuple(o.shape)}")
    if o.requires_grad:
        raise ValueError(f"{name} must not require grad")
    return o


def _optimizer_arg(value: Any) -> OptimizerSpec:
    return OptimizerSpec.of(value)


def _step_args(lr: Any, grad_divisor: Any) -> tuple[float, int]:
    lr = _float_arg(lr, "lr")
    grad_divisor = _int_arg(grad_divisor, "grad_divisor", minimum=1)
    if grad_divisor > 2**31 - 1:
        raise ValueError(f"grad_divisor must be < 2**31, got {grad_divisor}")
    return lr, grad_divisor


def _budget_arg(value: Any) -> int:
    """None -> 0 (unlimited), 'auto' -> -1, else bytes (int or '512M' / '4G' strings)."""
    return 0 if value is None else parse_memory_budget(value, "memory_budget")


def _init_args(
    init: Any, init_bound: Any, init_value: Any, seed: Any, key_bound: int | None
) -> tuple[str, float, float, int, list[int], list[float]]:
    if init not in _INIT_KINDS:
        raise ValueError(f"init must be one of {list(_INIT_KINDS)}, got {init!r}")
    seed = _int_arg(seed, "seed")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    value = _float_arg(init_value, "init_value")
    bound, starts, bounds = 0.0, [], []
    if init == "uniform":
        if init_bound is None:
            if key_bound is None or key_bound == 0:
                raise ValueError(
                    "init_bound is required for init='uniform' without key_bound (TorchRec's "
                    "default is sqrt(1 / num_embeddings) of each table)"
                )
            bound = math.sqrt(1.0 / key_bound)
        elif isinstance(init_bound, numbers.Real) and not isinstance(init_bound, bool):
            bound = _float_arg(init_bound, "init_bound")
            if bound < 0:
                raise ValueError(f"init_bound must be >= 0, got {bound}")
        elif isinstance(init_bound, Sequence) and not isinstance(init_bound, str):
            if not init_bound:
                raise ValueError("init_bound: the list of (start_key, bound) ranges is empty")
            for i, item in enumerate(init_bound):
                if not (isinstance(item, Sequence) and len(item) == 2):
                    raise TypeError(f"init_bound[{i}] must be a (start_key, bound) pair")
                starts.append(_int_arg(item[0], f"init_bound[{i}][0]"))
                b = _float_arg(item[1], f"init_bound[{i}][1]")
                if b < 0:
                    raise ValueError(f"init_bound[{i}][1] must be >= 0, got {b}")
                bounds.append(b)
            if any(b <= a for a, b in itertools.pairwise(starts)):
                raise ValueError("init_bound: range starts must be strictly increasing")
        else:
            raise TypeError(
                "init_bound must be None, a float or a list of (start_key, bound) pairs, got "
                f"{type(init_bound).__name__}"
            )
    return init, bound, value, seed, starts, bounds


def _path_arg(path: Any, name: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{name} must be a non-empty path")
    return text


def _f32(x: float) -> int:
    """The IEEE bits of x rounded to float32 (how the store keeps init parameters)."""
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified manifest of a checkpoint (dim, init, rows, meta, optimizer (its kind),
    optimizer_spec (an OptimizerSpec), state_dim, contents, ...), without its data."""
    info = dict(C.store_checkpoint_info(_path_arg(path, "path")))
    info["meta"] = dict(info["meta"])
    info["optimizer_spec"] = OptimizerSpec(**dict(info["optimizer_spec"]))
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
    k = _keys_arg(keys)
    dim = _int_arg(dim, "dim", minimum=1)
    kind, bound, value, seed, starts, bounds = _init_args(init, init_bound, init_value, seed, None)
    out = torch.empty((k.shape[0], dim), dtype=torch.float32)
    C.store_initial_rows(k, out.numpy(), kind, bound, value, seed, starts, bounds)
    return out


def initial_state(
    num_rows: int, dim: int, optimizer: OptimizerSpec | str | dict[str, Any] = "sgd"
) -> torch.Tensor:
    """The optimizer state of `num_rows` fresh rows, (num_rows, state_dim) float32 (what a
    store returns for unwritten keys; the same for every key)."""
    num_rows = _int_arg(num_rows, "num_rows", minimum=0)
    dim = _int_arg(dim, "dim", minimum=1)
    spec = _optimizer_arg(optimizer)
    out = torch.empty((num_rows, spec.state_dim(dim)), dtype=torch.float32)
    C.store_initial_state(out.numpy(), dim, spec.as_tuple())
    return out


class EmbeddingStore:
    """fp32 rows of one dimension keyed by int64, each with the state of the store's optimizer
    (see docs/ARCHITECTURE.md §2).

    Every row that was never written reads as its deterministic initial value and initial
    state. All batch operations take 1-D contiguous int64 CPU key tensors and (n, dim)
    contiguous float32 CPU row tensors (state: (n, state_dim)); a bad argument raises
    TypeError / ValueError naming it, before anything is written. Results are bitwise
    independent of ``num_threads`` and ``num_shards``.
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
        optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
    ) -> None:
        dim = _int_arg(dim, "dim", minimum=1)
        spec = _optimizer_arg(optimizer)
        num_shards = _int_arg(num_shards, "num_shards", minimum=1)
        num_threads = _int_arg(num_threads, "num_threads", minimum=1)
        if key_bound is not None:
            key_bound = _int_arg(key_bound, "key_bound", minimum=1)
        kind, bound, value, seed, starts, bounds = _init_args(
            init, init_bound, init_value, seed, key_bound
        )
        budget = _budget_arg(memory_budget)
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise TypeError(f"spill_dir must be a path, got {type(spill_dir).__name__}")
        high = _float_arg(high_watermark, "high_watermark")
        low = _float_arg(low_watermark, "low_watermark")
        rows_per_page = 0 if page_rows is None else _int_arg(page_rows, "page_rows", minimum=1)
        self._core = C.StoreCore(
            dim,
            num_shards,
            num_threads,
            kind,
            bound,
            value,
            seed,
            starts,
            bounds,
            -1 if key_bound is None else key_bound,
            rows_per_page,
            budget,
            "" if spill_dir is None else os.fspath(spill_dir),
            high,
            low,
            spec.as_tuple(),
        )
        self._dim = dim
        self._optimizer = spec
        self._state_dim = spec.state_dim(dim)
        self.meta: dict[str, str] = {}

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
        options["optimizer"] = OptimizerSpec(**dict(options["optimizer"]))
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
        k = _keys_arg(keys)
        o = _out_arg(out, "out", k.shape[0], self._dim)
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
        k = _keys_arg(keys)
        n = k.shape[0]
        o = _out_arg(out, "out", n, self._dim)
        so = _out_arg(state_out, "state_out", n, self._state_dim)
        self._core.lookup(k, o.numpy(), bool(insert_missing), so.numpy())
        return o, so

    def assign(
        self, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None = None
    ) -> None:
        """Sets the rows of `keys` and, with `state` ((n, state_dim)), their optimizer state;
        for duplicate keys the last occurrence wins. Without `state`, stored rows keep their
        state and new rows start from the initial state."""
        k = _keys_arg(keys)
        n = k.shape[0]
        r = _rows_arg(rows, "rows", n, self._dim)
        self._core.assign(k, r, _state_arg(state, "state", n, self._state_dim))

    def apply_gradients(
        self, keys: torch.Tensor, grads: torch.Tensor, lr: float, grad_divisor: int = 1
    ) -> None:
        """One update per distinct key with the store's optimizer, applied to the sum of its
        gradient rows in input order divided by `grad_divisor` (the arithmetic contract of
        csrc/store/embedding_store.h). For Adam, `lr` is the bias-corrected step size
        (`torchrec_bagpipe.ps.optimizers.adam_step_size`)."""
        k = _keys_arg(keys)
        g = _rows_arg(grads, "grads", k.shape[0], self._dim)
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
        k = _keys_arg(keys)
        g = _rows_arg(grads, "grads", k.shape[0], self._dim)
        lr, grad_divisor = _step_args(lr, grad_divisor)
        self._core.apply_sgd(k, g, lr, grad_divisor)

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """A bool tensor: whether each key is stored."""
        k = _keys_arg(keys)
        out = torch.empty(k.shape[0], dtype=torch.uint8)
        self._core.contains(k, out.numpy())
        return out.view(torch.bool)

    def erase(self, keys: torch.Tensor) -> int:
        """Removes the present keys; returns how many distinct keys were removed."""
        return int(self._core.erase(_keys_arg(keys)))

    def reserve(self, n: int) -> None:
        """Prepares key-map capacity for `n` rows in total (outside the hot path)."""
        self._core.reserve(_int_arg(n, "n", minimum=0))

    def export(
        self, chunk_rows: int = 65536, *, with_state: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yields (keys, rows) chunks of every stored row, in a deterministic order;
        ``with_state=True``: (keys, rows, state) chunks.

        The store must not change while the iterator is consumed (ValueError otherwise).
        """
        chunk_rows = _int_arg(chunk_rows, "chunk_rows", minimum=1)
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
        slot_bytes (arena bytes of one row: weights and optimizer state, with padding)."""
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
        path = _path_arg(path, "path")
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
        optimizer: OptimizerSpec | str | dict[str, Any] | None = None,
    ) -> EmbeddingStore:
        """Opens a checkpoint written by `save` (this or an older format version).

        `dim`, `init`, `init_bound`, `init_value` and `seed`, when given, are expectations: a
        checkpoint that disagrees is refused with a ValueError naming the field. So is
        `optimizer` (naming the first differing field, e.g. ``optimizer.eps``), unless the
        load is weights-only (``weights_only=True`` or a weights-only checkpoint): then it
        may change the optimizer and every row starts from the initial state. Unset, the
        store runs the checkpoint's optimizer. The other arguments override the checkpoint's
        layout (shards, page rows, key bound) or set the runtime options (threads, budget,
        spill). A torn, corrupt or unknown-version checkpoint raises ValueError.
        """
        path = _path_arg(path, "path")
        spec = None if optimizer is None else _optimizer_arg(optimizer)
        info = checkpoint_info(path)
        if dim is not None:
            _int_arg(dim, "dim", minimum=1)
        if init is not None and init != info["init"]:
            raise ValueError(
                f"init: the checkpoint in {path} uses init={info['init']!r}, expected {init!r}"
            )
        if seed is not None and _int_arg(seed, "seed") != info["seed"]:
            raise ValueError(f"seed: the checkpoint in {path} uses seed={info['seed']}, got {seed}")
        if (
            init_value is not None
            and info["init"] == "constant"
            and _f32(_float_arg(init_value, "init_value")) != _f32(info["init_value"])
        ):
            raise ValueError(
                f"init_value: the checkpoint in {path} uses {info['init_value']}, got {init_value}"
            )
        if init_bound is not None and info["init"] == "uniform":
            _, bound, _, _, starts, bounds = _init_args(
                "uniform", init_bound, 0.0, 0, info["key_bound"] if info["key_bound"] > 0 else None
            )
            same = (
                starts == list(info["bound_starts"])
                and [_f32(b) for b in bounds] == [_f32(b) for b in info["bound_values"]]
                and (starts or _f32(bound) == _f32(info["init_bound"]))
            )
            if not same:
                raise ValueError(
                    f"init_bound: the checkpoint in {path} was written with a different bound"
                )

        def opt_int(value: Any, name: str, minimum: int) -> int | None:
            return None if value is None else _int_arg(value, name, minimum=minimum)

        def opt_float(value: Any, name: str) -> float | None:
            return None if value is None else _float_arg(value, name)

        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise TypeError(f"spill_dir must be a path, got {type(spill_dir).__name__}")
        core, meta = C.store_load(
            path,
            opt_int(num_shards, "num_shards", 1),
            opt_int(num_threads, "num_threads", 1),
            opt_int(key_bound, "key_bound", 1),
            opt_int(page_rows, "page_rows", 1),
            None if memory_budget is None else _budget_arg(memory_budget),
            None if spill_dir is None else os.fspath(spill_dir),
            opt_float(high_watermark, "high_watermark"),
            opt_float(low_watermark, "low_watermark"),
            dim,
            bool(weights_only),
            None if spec is None else spec.as_tuple(),
        )
        store = cls.__new__(cls)
        store._core = core
        options = core.options()
        store._dim = int(options["dim"])
        store._optimizer = OptimizerSpec(**dict(options["optimizer"]))
        store._state_dim = int(core.state_dim())
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

    @staticmethod
    def initial_state(
        num_rows: int, dim: int, optimizer: OptimizerSpec | str | dict[str, Any] = "sgd"
    ) -> torch.Tensor:
        """The optimizer state of `num_rows` fresh rows, (num_rows, state_dim) float32."""
        return initial_state(num_rows, dim, optimizer)
