"""`ShardedBagPipeEmbeddingBagCollection`: an EmbeddingBagCollection whose rows live in the PS.

Data flow of one training batch (ARCHITECTURE §5):

* `input_dist` (called one or more batches ahead by TrainPipelineSparseDist) validates the
  KJT, turns it into fused keys per fused table and submits them to the runtime
  (`BagPipeController.submit`), unless `BagPipeTrainPipeline` already submitted that batch
  ahead (then it only checks the batch is the one submitted). It returns a
  `KJTListSplitsAwaitable` holding the batch's features permuted into slot order.
* `compute` takes the oldest step from each controller (`next_step`): the batch's unique
  rows as a |U| x dim leaf tensor and the inverse map; it pools them with
  `torch.nn.functional.embedding_bag` (sum, or sum / bag length for mean), so autograd
  yields exactly the |U| x dim row gradient. A hook on the leaf hands that gradient to the
  fused SGD optimizer, which calls `finish_step`.
* `output_dist` returns the `KeyedTensor` in the unsharded EBC's key order.

Eval (module not training) and no-grad forwards read the rows straight from the PS after
draining pending commits; they never enter the runtime's step sequence.

Thread-safety: one training thread per rank (the autograd thread runs the backward hook
while that thread waits in backward).

Invariants:
1. Each controller's steps are consumed in submission order; `compute` checks the step it
   gets belongs to its batch (same fused keys) and refuses anything else.
2. At most one step per fused table is in flight between `compute` and its gradient; a new
   `compute` first finishes a step that received no gradient with a zero gradient.
3. The PS is the only owner of row values; `state_dict` reads them back after a flush and
   `load_state_dict` writes them, then invalidates every rank's cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import re
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    KJTList,
)
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    LazyNoWait,
    NoWait,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    get_embedding_names_by_table,
)
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed import ps_runtime
from torchrec_bagpipe.distributed.fused_optimizer import BagPipeFusedOptimizer, sgd_lr_from
from torchrec_bagpipe.distributed.types import (
    BagPipeEBCContext,
    FusedTableSpec,
    SlotSpec,
    TableSpec,
)

__all__ = ["BAGPIPE_KERNEL", "ShardedBagPipeEmbeddingBagCollection"]

BAGPIPE_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value

# Rows per PS request when materialising or writing whole tables.
_TABLE_CHUNK_ROWS = 1 << 16


class _PSTableView(nn.Module):
    """`embedding_bags.<table>`: a placeholder `weight` plus state-dict access to the PS.

    The placeholder is an empty (0, dim) parameter that carries `_in_backward_optimizers`
    (so TorchRec's `in_backward_optimizer_filter` keeps it out of the dense optimizer) and
    never receives a gradient; the table's values are read from / written to the PS.
    """

    def __init__(self, owner: ShardedBagPipeEmbeddingBagCollection, table: str, dim: int,
                 device: torch.device) -> None:
        super().__init__()
        # A plain attribute, not a submodule: registering the owner would make the module
        # tree cyclic (named_modules, state_dict and .to() would loop).
        object.__setattr__(self, "_owner", owner)
        self._table = table
        weight = nn.Parameter(torch.empty(0, dim, device=device), requires_grad=False)
        weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        self.weight = weight

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        destination[prefix + "weight"] = self._owner.read_table(self._table)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        shape = self._owner.table_shape(self._table)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {got}, the BagPipe "
                f"table {self._table!r} has shape {shape}"
            )
            return
        self._owner.write_table(self._table, value)


class ShardedBagPipeEmbeddingBagCollection(
    ShardedModule[KJTList, KeyedTensor, KeyedTensor, BagPipeEBCContext],
    FusedOptimizerModule,
):
    """Sharded EBC whose tables live in the BagPipe PS (see module docstring)."""

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        config: BagPipeConfig | None = None,
        fused_params: Mapping[str, Any] | None = None,
        module_fqn: str | None = None,
    ) -> None:
        super().__init__()
        self._config = config if config is not None else BagPipeConfig()
        self._env = env
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._module_fqn = module_fqn or ""
        self._is_weighted = bool(module.is_weighted())
        where = f"BagPipe EBC {self._module_fqn or '<root>'}"

        configs = module.embedding_bag_configs()
        for cfg in configs:
            ps = table_name_to_parameter_sharding.get(cfg.name)
            if ps is None:
                raise ValueError(f"{where}: the sharding plan has no entry for table {cfg.name!r}")
            if ps.compute_kernel != BAGPIPE_KERNEL:
                raise ValueError(
                    f"{where}: table {cfg.name!r} has compute kernel {ps.compute_kernel!r}; "
                    f"ShardedBagPipeEmbeddingBagCollection serves {BAGPIPE_KERNEL!r} only"
                )
            if ps.sharding_type != ShardingType.DATA_PARALLEL.value:
                raise ValueError(
                    f"{where}: table {cfg.name!r} has sharding type {ps.sharding_type!r}; "
                    "BagPipe places the compute data-parallel (rows live in the PS)"
                )
            if cfg.data_type != DataType.FP32:
                raise ValueError(
                    f"{where}: table {cfg.name!r} has data type {cfg.data_type}; BagPipe "
                    "trains FP32 tables only"
                )
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(
                    f"{where}: table {cfg.name!r} uses {cfg.pooling} pooling; BagPipe "
                    "supports SUM and MEAN"
                )

        # ---- tables, slots and fused tables ------------------------------------------------
        self._tables: list[TableSpec] = []
        for cfg in configs:
            weight = module.embedding_bags[cfg.name].weight
            lr = sgd_lr_from(weight, fused_params, f"{where}, table {cfg.name!r}")
            self._tables.append(
                TableSpec(
                    name=cfg.name,
                    num_embeddings=int(cfg.num_embeddings),
                    dim=int(cfg.embedding_dim),
                    feature_names=tuple(cfg.feature_names),
                    pooling="mean" if cfg.pooling == PoolingType.MEAN else "sum",
                    lr=lr,
                    init_min=float(cfg.get_weight_init_min()),
                    init_max=float(cfg.get_weight_init_max()),
                )
            )
        self._table_by_name = {t.name: t for t in self._tables}
        names_by_table = get_embedding_names_by_table(configs)
        self._slots: list[SlotSpec] = []
        for t, names in zip(self._tables, names_by_table):
            for feature, key in zip(t.feature_names, names):
                self._slots.append(
                    SlotSpec(len(self._slots), t.name, feature, key, t.dim, t.pooling == "mean")
                )
        self._embedding_names = [s.key for s in self._slots]
        self._embedding_dims = [s.dim for s in self._slots]

        by_group: dict[tuple[int, float], list[TableSpec]] = {}
        for t in self._tables:
            by_group.setdefault((t.dim, t.lr), []).append(t)
        self._job = ps_runtime.job_for(self._config, env, self._device)
        session = self._job.next_session_id()
        self._fused: list[FusedTableSpec] = []
        for i, ((dim, lr), tables) in enumerate(by_group.items()):
            offsets: dict[str, int] = {}
            total = 0
            for t in tables:
                offsets[t.name] = total
                total += t.num_embeddings
            spec = FusedTableSpec(
                name=_session_table_name(session, self._module_fqn, i, dim),
                dim=dim, lr=lr, tables=tables, offsets=offsets, num_keys=total,
            )
            spec.slots = [s for s in self._slots if self._table_by_name[s.table] in tables]
            self._fused.append(spec)
        self._group_of_table = {
            t.name: g for g, spec in enumerate(self._fused) for t in spec.tables
        }
        # Per fused table: slot features, per-slot key offset and id bound (CPU tensors).
        self._slot_offsets = [
            torch.tensor([spec.offsets[s.table] for s in spec.slots], dtype=torch.int64)
            for spec in self._fused
        ]
        self._slot_limits = [
            torch.tensor([self._table_by_name[s.table].num_embeddings for s in spec.slots],
                         dtype=torch.int64)
            for spec in self._fused
        ]
        self._slot_mean = [
            torch.tensor([s.mean for s in spec.slots], dtype=torch.bool) for spec in self._fused
        ]
        self._has_mean = [any(s.mean for s in spec.slots) for spec in self._fused]
        self._perms: dict[tuple[str, ...], list[list[int] | None]] = {}
        # Output columns: the fused tables' pooled values come out grouped by fused table;
        # when that is not the EBC's slot order, one column gather restores it.
        grouped = [s for spec in self._fused for s in spec.slots]
        self._output_columns: torch.Tensor | None = None
        if [s.index for s in grouped] != list(range(len(grouped))):
            start: dict[int, int] = {}
            col = 0
            for s in grouped:
                start[s.index] = col
                col += s.dim
            self._output_columns = torch.cat([
                torch.arange(start[s.index], start[s.index] + s.dim) for s in self._slots
            ]).to(self._device)

        # ---- runtime: PS sessions and controllers ----------------------------------------
        meta = {t.name: module.embedding_bags[t.name].weight.is_meta for t in self._tables}
        init_fns = {cfg.name: cfg.init_fn for cfg in configs}
        self._runtimes: list[ps_runtime.FusedTableRuntime] = []
        try:
            for spec in self._fused:
                self._runtimes.append(ps_runtime.build_fused_table(
                    spec,
                    job=self._job,
                    config=self._config,
                    lazy_init=all(meta[t.name] and _default_uniform(init_fns[t.name], t)
                                  for t in spec.tables),
                ))
            self._load_initial_weights(module, meta, init_fns)
        except BaseException:
            for rt in self._runtimes:
                with contextlib.suppress(Exception):
                    rt.close()
            raise

        # ---- torch state: placeholders, fused optimizer ------------------------------------
        self.embedding_bags = nn.ModuleDict(
            {t.name: _PSTableView(self, t.name, t.dim, self._device) for t in self._tables}
        )
        params = {f"embedding_bags.{t.name}.weight": self.embedding_bags[t.name].weight
                  for t in self._tables}
        self._optim = BagPipeFusedOptimizer(
            params,
            [
                (spec.name, spec.lr,
                 [self.embedding_bags[t.name].weight for t in spec.tables])
                for spec in self._fused
            ],
            finish_fn=self._finish,
            pending_fn=self._finish_pending,
        )

        # ---- step bookkeeping ------------------------------------------------------------
        self._loaded = False
        self._presubmitted: deque[_Ahead] = deque()
        self._held: list[list[torch.Tensor]] | None = None
        self._pending: list[deque[Any]] = [deque() for _ in self._fused]
        self._closed = False
        self._job.register(self)
        self.register_load_state_dict_post_hook(_after_load)

    # ---- TorchRec ShardedModule API ------------------------------------------------------------
    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optim

    def create_context(self) -> BagPipeEBCContext:
        return BagPipeEBCContext()

    def input_dist(  # type: ignore[override]
        self, ctx: BagPipeEBCContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        self._check_open()
        ahead = self._presubmitted[0] if self.training and self._presubmitted else None
        if ahead is not None and _same_data(ahead.signature, _signature(features)):
            # The very tensors submitted ahead (not modified since): reuse their split.
            per_group, keys = ahead.per_group, ahead.keys
        else:
            per_group, keys = self._split_features(features)
        ctx.training = self.training
        ctx.batch_size = features.stride()
        ctx.keys = keys
        if self.training:
            self._enter_window(keys)
        return KJTListSplitsAwaitable(
            [NoWait(NoWait(k)) for k in per_group], ctx, self._module_fqn, None
        )

    def compute(self, ctx: BagPipeEBCContext, dist_input: KJTList) -> KeyedTensor:
        self._check_open()
        b = ctx.batch_size
        parts: list[torch.Tensor] = []
        for g, spec in enumerate(self._fused):
            kjt = dist_input[g]
            if ctx.training:
                rows, inverse = self._train_rows(g, ctx.keys[g])
            else:
                rows, inverse = self._eval_rows(g, ctx.keys[g])
            pooled = self._pool(g, kjt, rows, inverse)
            # Slot-major (slots x batch x dim) -> batch x (slots * dim): one copy, whose
            # backward is one copy too (per-slot views would each back-propagate a zero-filled
            # gradient of the whole pooled tensor).
            parts.append(pooled.view(len(spec.slots), b, spec.dim).transpose(0, 1)
                         .reshape(b, len(spec.slots) * spec.dim))
        if not parts:
            values = torch.empty(b, 0, device=self._device)
        else:
            values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if self._output_columns is not None:
                values = values.index_select(1, self._output_columns)
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._embedding_dims,
            values=values,
            key_dim=1,
        )

    def output_dist(
        self, ctx: BagPipeEBCContext, output: KeyedTensor
    ) -> LazyAwaitable[KeyedTensor]:
        return LazyNoWait(output)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        for name, _ in self.named_parameters(prefix):
            yield name

    # ---- BagPipe extensions (used by BagPipeTrainPipeline and tools) ------------------------
    def presubmit(self, features: KeyedJaggedTensor) -> None:
        """Submits a future training batch to the runtime's lookahead window.

        `input_dist` of the same batch, later, then only checks it matches.
        """
        self._check_open()
        per_group, keys = self._split_features(features)
        self._submit(keys)
        self._presubmitted.append(_Ahead(_signature(features), per_group, keys))

    def hold_submissions(self) -> None:
        """Queues the batches `input_dist` would submit until `release_submissions`."""
        if self._held is None:
            self._held = []

    def release_submissions(self) -> None:
        held, self._held = self._held, None
        for keys in held or []:
            self._submit(keys)

    def prescan(self, features: Iterable[KeyedJaggedTensor],
                progress: bool | None = None) -> None:
        """Hands the whole trace (every step's local batch, in order) to each controller
        (a collective: every rank calls it). `progress`: show the planner's bar (default:
        on rank 0).

        REQUIRES: no batch submitted yet; `optimization_prescan` set in the config.
        """
        self._check_open()
        if not self._config.optimization_prescan:
            raise ValueError(
                "prescan() needs BagPipeConfig(optimization_prescan=True) "
                "(--optimization-prescan)"
            )
        traces: list[list[torch.Tensor]] = [[] for _ in self._fused]
        for kjt in features:
            _, keys = self._split_features(kjt)
            for g, k in enumerate(keys):
                traces[g].append(k)
        show = self._job.rank == 0 if progress is None else progress
        for g, rt in enumerate(self._runtimes):
            rt.controller.prescan(traces[g], progress=show)

    def bagpipe_metrics(self) -> dict[str, dict[str, Any]]:
        """Runtime metrics per fused table (the controllers' plain dicts)."""
        return {spec.name: rt.controller.metrics() for spec, rt in zip(self._fused, self._runtimes)}

    @property
    def bagpipe_config(self) -> BagPipeConfig:
        return self._config

    def flush(self) -> None:
        """Finishes gradient-less steps and waits until every pending commit is applied."""
        self._finish_pending()
        for rt in self._runtimes:
            rt.controller.flush()

    def close(self) -> None:
        """Drains pending commits and closes the runtime (idempotent)."""
        if self._closed:
            return
        try:
            self._finish_pending(check_lr=False)
            for rt in self._runtimes:
                rt.controller.flush()
        finally:
            self._closed = True
            for rt in self._runtimes:
                rt.close()
            self._job.unregister(self)

    # ---- state dict access ------------------------------------------------------------------
    def table_shape(self, table: str) -> tuple[int, int]:
        t = self._table_by_name[table]
        return (t.num_embeddings, t.dim)

    def read_table(self, table: str) -> torch.Tensor:
        """The table's current values, read from the PS after draining pending commits."""
        self._check_open()
        g = self._group_of_table[table]
        self._finish_pending()
        self._runtimes[g].controller.flush()
        start, stop = self._fused[g].table_range(table)
        client = self._runtimes[g].client
        parts = []
        for lo in range(start, stop, _TABLE_CHUNK_ROWS):
            keys = torch.arange(lo, min(stop, lo + _TABLE_CHUNK_ROWS), dtype=torch.int64)
            parts.append(client.lookup(keys))
        dim = self._fused[g].dim
        return torch.cat(parts) if parts else torch.empty(0, dim)

    def write_table(self, table: str, value: torch.Tensor) -> None:
        """Writes a whole table into the PS (rank 0 writes; `_after_load` synchronises)."""
        self._check_open()
        g = self._group_of_table[table]
        self._finish_pending()
        self._runtimes[g].controller.flush()
        if self._job.rank == 0:
            start, _stop = self._fused[g].table_range(table)
            self._assign_rows(g, start, value)
        self._loaded = True

    def _after_load(self) -> None:
        if not getattr(self, "_loaded", False):
            return
        self._loaded = False
        self._job.control.barrier()
        for rt in self._runtimes:
            rt.controller.invalidate_all()

    # ---- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this BagPipe EBC was closed; its PS session is gone")

    def _load_initial_weights(self, module: EmbeddingBagCollection, meta: dict[str, bool],
                              init_fns: dict[str, Any]) -> None:
        """Copies the unsharded module's weights into the PS (rank 0 writes), or leaves
        default-initialised meta tables to the PS's deterministic lazy init."""
        wrote = False
        for g, spec in enumerate(self._fused):
            lazy = self._runtimes[g].lazy_init
            for t in spec.tables:
                if meta[t.name] and lazy:
                    continue
                wrote = True
                if self._job.rank != 0:
                    continue
                if meta[t.name]:
                    # A meta table with a custom init_fn: materialise it like DMP would.
                    weight = torch.empty(t.num_embeddings, t.dim)
                    init_fns[t.name](weight)
                else:
                    weight = module.embedding_bags[t.name].weight.detach()
                self._assign_rows(g, spec.offsets[t.name], weight)
        # Every rank waits until rank 0's writes are in the PS before any step reads them.
        if wrote:
            self._job.control.barrier()

    def _assign_rows(self, g: int, start: int, weight: torch.Tensor) -> None:
        client = self._runtimes[g].client
        n = weight.shape[0]
        for lo in range(0, n, _TABLE_CHUNK_ROWS):
            hi = min(n, lo + _TABLE_CHUNK_ROWS)
            rows = weight[lo:hi].detach().to("cpu", torch.float32).contiguous()
            keys = torch.arange(start + lo, start + hi, dtype=torch.int64)
            client.assign(keys, rows)

    def _split_features(
        self, features: KeyedJaggedTensor
    ) -> tuple[list[KeyedJaggedTensor], list[torch.Tensor]]:
        """Per fused table: the KJT permuted into slot order and its validated fused keys."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"BagPipe EBC expects a KeyedJaggedTensor, got {type(features).__name__}"
            )
        if features.variable_stride_per_key():
            raise ValueError(
                "BagPipe EBC does not support variable batch sizes per feature (VBE KJTs)"
            )
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError("this EmbeddingBagCollection is weighted but the KJT has no weights")
        perms = self._perms.get(tuple(features.keys()))
        if perms is None:
            perms = self._permutations(features.keys())
        per_group: list[KeyedJaggedTensor] = []
        keys: list[torch.Tensor] = []
        for g, perm in enumerate(perms):
            kjt = features if perm is None else features.permute(perm)
            if not self._is_weighted and kjt.weights_or_none() is not None:
                kjt = KeyedJaggedTensor(
                    keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                    offsets=kjt.offsets(), stride=kjt.stride(),
                )
            per_group.append(kjt)
            keys.append(self._fused_keys(g, kjt))
        return per_group, keys

    def _permutations(self, kjt_keys: list[str]) -> list[list[int] | None]:
        """Per fused table: the KJT permutation into slot order (None: the KJT already is in
        that order, with no extra keys). Cached per key order."""
        index = {k: i for i, k in enumerate(kjt_keys)}
        perms: list[list[int] | None] = []
        for spec in self._fused:
            try:
                perm = [index[s.feature] for s in spec.slots]
            except KeyError as e:
                raise ValueError(
                    f"the KJT has no feature {e.args[0]!r} (needed by table "
                    f"{next(s.table for s in spec.slots if s.feature == e.args[0])!r}); "
                    f"its keys are {kjt_keys}"
                ) from None
            perms.append(None if perm == list(range(len(kjt_keys))) else perm)
        if len(self._perms) < 64:  # key orders seen (bounded: the order may vary per batch)
            self._perms[tuple(kjt_keys)] = perms
        return perms

    def _fused_keys(self, g: int, kjt: KeyedJaggedTensor) -> torch.Tensor:
        ids = kjt.values().to("cpu", torch.int64)
        counts = torch.tensor(kjt.length_per_key(), dtype=torch.int64)
        limits = torch.repeat_interleave(self._slot_limits[g], counts, output_size=ids.numel())
        bad = (ids < 0) | (ids >= limits)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0].item())
            slot_i = int(torch.searchsorted(torch.cumsum(counts, 0), pos, right=True).item())
            slot = self._fused[g].slots[slot_i]
            n = self._table_by_name[slot.table].num_embeddings
            raise ValueError(
                f"feature {slot.feature!r} of table {slot.table!r} has id {int(ids[pos])} "
                f"outside [0, {n})"
            )
        offsets = torch.repeat_interleave(self._slot_offsets[g], counts, output_size=ids.numel())
        return ids + offsets

    def _submit(self, keys: list[torch.Tensor]) -> None:
        for rt, k in zip(self._runtimes, keys):
            rt.controller.submit(k)

    def _enter_window(self, keys: list[torch.Tensor]) -> None:
        if self._presubmitted:
            expected = self._presubmitted.popleft().keys
            if any(a is not b and not torch.equal(a, b) for a, b in zip(expected, keys)):
                raise RuntimeError(
                    "the batch entering input_dist is not the batch BagPipeTrainPipeline "
                    "submitted ahead for this step; feed the pipeline and the model the "
                    "same batches in the same order"
                )
            return
        if self._held is not None:
            self._held.append(keys)
            return
        self._submit(keys)

    def _train_rows(self, g: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending[g]:
            self._finish_pending()
        step = self._runtimes[g].controller.next_step()
        inverse = step.inverse
        step_keys = getattr(step, "keys", None)
        if step_keys is None and inverse.device.type == "cpu":
            step_keys = step.unique_keys[inverse]
        if inverse.numel() != keys.numel() or (
            step_keys is not None and not torch.equal(step_keys, keys)
        ):
            raise RuntimeError(
                f"BagPipe fused table {self._fused[g].name!r}: the runtime's next step is not "
                "this batch (steps must be consumed in submission order)"
            )
        rows = step.rows
        if not torch.is_grad_enabled():
            # A training-mode forward without autograd: the step commits a zero gradient.
            self._pending[g].append(step)
            self._finish_pending()
            return rows.detach(), inverse
        if not rows.requires_grad:
            rows.requires_grad_(True)
        self._pending[g].append(step)
        rows.register_hook(functools.partial(self._on_rows_grad, g, step))
        return rows, inverse

    def _eval_rows(self, g: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._finish_pending()
        rt = self._runtimes[g]
        rt.controller.flush()
        unique, inverse = torch.unique(keys, return_inverse=True)
        rows = rt.client.lookup(unique).to(self._device)
        return rows, inverse.to(self._device)

    def _pool(self, g: int, kjt: KeyedJaggedTensor, rows: torch.Tensor,
              inverse: torch.Tensor) -> torch.Tensor:
        offsets = kjt.offsets().to(device=rows.device, dtype=torch.int64)
        weights = kjt.weights_or_none() if self._is_weighted else None
        if weights is not None:
            weights = weights.to(device=rows.device, dtype=rows.dtype)
        pooled = F.embedding_bag(
            inverse.to(device=rows.device, dtype=torch.int64), rows, offsets,
            mode="sum", per_sample_weights=weights, include_last_offset=True,
        )
        if self._has_mean[g]:
            mean = self._slot_mean[g]
            b = kjt.stride()
            lengths = kjt.lengths().to(device=rows.device, dtype=rows.dtype)
            is_mean = mean.to(rows.device).repeat_interleave(b)
            denom = torch.where(is_mean, lengths.clamp(min=1.0), torch.ones_like(lengths))
            pooled = pooled / denom.unsqueeze(1)
        return pooled

    def _on_rows_grad(self, g: int, step: Any, grad: torch.Tensor) -> None:
        pending = self._pending[g]
        if not pending or pending[0] is not step:
            raise RuntimeError(
                f"BagPipe fused table {self._fused[g].name!r}: a gradient arrived for a step "
                "that is already finished (backward ran twice through one forward?)"
            )
        self._optim.finish(g, step, grad.detach())

    def _finish(self, g: int, step: Any, grad: torch.Tensor) -> None:
        pending = self._pending[g]
        assert pending and pending[0] is step
        pending.popleft()
        self._runtimes[g].controller.finish_step(step, grad)

    def _finish_pending(self, check_lr: bool = True) -> None:
        """Finishes, with a zero gradient, every step that received none."""
        for g, pending in enumerate(self._pending):
            while pending:
                step = pending[0]
                zeros = torch.zeros_like(step.rows.detach(), memory_format=torch.contiguous_format)
                if check_lr:
                    self._optim.finish(g, step, zeros)
                else:
                    self._finish(g, step, zeros)


@dataclass
class _Ahead:
    """A batch submitted ahead by the pipeline, with the split `input_dist` can reuse."""

    signature: tuple[Any, ...]
    per_group: list[KeyedJaggedTensor]
    keys: list[torch.Tensor]


def _signature(features: KeyedJaggedTensor) -> tuple[Any, ...]:
    """A KJT's keys, stride and data tensors with their in-place versions (the tensors are
    held, so their identity cannot be reused while the signature lives)."""
    tensors = (features.values(), features.lengths_or_none(), features.offsets_or_none(),
               features.weights_or_none())
    return (tuple(features.keys()), features.stride(),
            *((t, t._version) if t is not None else (None, 0) for t in tensors))


def _same_data(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two signatures name the same, unmodified tensors (TorchRec's CPU device copy
    of a batch keeps them), so the split computed ahead can be reused without a compare."""
    if a[:2] != b[:2]:
        return False
    return all(x[0] is y[0] and x[1] == y[1] for x, y in zip(a[2:], b[2:]))


def _after_load(module: nn.Module, incompatible_keys: Any) -> None:
    assert isinstance(module, ShardedBagPipeEmbeddingBagCollection)
    module._after_load()


def _session_table_name(session: int, fqn: str, index: int, dim: int) -> str:
    """The PS table name of a fused table: unique per job, 1-128 chars of [A-Za-z0-9_.:-]."""
    safe = re.sub(r"[^A-Za-z0-9_.:-]", "_", fqn or "ebc")
    tail = f"-f{index}-d{dim}"
    head = f"s{session}:"
    room = 128 - len(head) - len(tail)
    if len(safe) > room:
        digest = hashlib.blake2b(safe.encode(), digest_size=6).hexdigest()
        safe = safe[: room - len(digest) - 1] + "_" + digest
    return head + safe + tail


def _default_uniform(init_fn: Any, table: TableSpec) -> bool:
    """Whether `init_fn` is TorchRec's default symmetric uniform init for the table."""
    if not isinstance(init_fn, functools.partial) or init_fn.func is not torch.nn.init.uniform_:
        return False
    a = init_fn.keywords.get("a")
    b = init_fn.keywords.get("b")
    return (
        a is not None and b is not None and math.isclose(-float(a), float(b))
        and math.isclose(float(b), table.init_max)
    )
