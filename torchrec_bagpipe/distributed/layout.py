"""Layout of a BagPipe-sharded module: where every table, feature and id goes.

Built once per sharded module from its tables' configs (types.py names the pieces):

* tables (`TableSpec`), in the module's order; slots (`SlotSpec`): (table, feature) pairs in
  output order, keyed as TorchRec keys them;
* fused tables (`FusedTableSpec`): the tables of one (dim, optimizer, lr) share one key space,
  `fused key = table offset + id`, under a PS table name unique per job;
* for each input KJT: its permutation into each fused table's slot order (cached per key
  order), and the batch's fused keys, with every id checked against its table's range;
* the output column order: the fused tables' slots come out grouped by fused table; when
  that is not the module's slot order, the sharded module's output gathers the columns
  back (`grouped_slots`).

The layout knows nothing about pooling or the PS: step_lifecycle.py turns fused keys into
rows, lookup.py rows into outputs, fused_table_runtime.py reaches the PS.

Invariants:
1. Within a fused table, table offsets are increasing and disjoint:
   `offset[t+1] = offset[t] + num_embeddings[t]`; `num_keys` is their sum.
2. Every slot belongs to exactly one fused table; `FusedTableSpec.slots` lists them in
   module order, and the per-slot tensors below follow that order.
3. `fused_keys` returns keys in `[0, num_keys)` only; any id outside its table's range is a
   `ValueError` naming the feature, the table and the id; a malformed KJT (non-integer ids,
   negative or inconsistent lengths/offsets: input_check.py) is refused before that.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    PoolingType,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.distributed.input_check import check_kjt
from torchrec_bagpipe.distributed.table_optimizer import TableOptimizer
from torchrec_bagpipe.distributed.types import (
    BAGPIPE_KERNEL,
    FusedTableSpec,
    SlotSpec,
    TableSpec,
)
from torchrec_bagpipe.distributed.virtual_tables import eviction_spec_of

__all__ = [
    "FusedLayout",
    "check_bagpipe_table",
    "session_table_name",
    "split_plan",
    "table_specs",
]

# Key orders whose permutations a layout remembers (the order may change from batch to batch).
_MAX_CACHED_KEY_ORDERS = 64


def split_plan(configs: Sequence[BaseEmbeddingConfig],
               plan: Mapping[str, ParameterSharding], where: str
               ) -> tuple[list[BaseEmbeddingConfig], list[BaseEmbeddingConfig]]:
    """(tables the plan places on BagPipe, tables that keep stock TorchRec sharding), each
    in module order. ValueError naming the table for a table the plan omits or a BagPipe
    placement BagPipe cannot serve (`check_bagpipe_table`)."""
    ours: list[BaseEmbeddingConfig] = []
    stock: list[BaseEmbeddingConfig] = []
    for cfg in configs:
        if int(cfg.num_embeddings) < 1 or int(cfg.embedding_dim) < 1:
            raise ValueError(
                f"{where}: table {cfg.name!r} has {cfg.num_embeddings} rows of dim "
                f"{cfg.embedding_dim}; a BagPipe table needs at least one row and dim >= 1"
            )
        ps = plan.get(cfg.name)
        if ps is None:
            raise ValueError(
                f"{where}: the sharding plan has no entry for table {cfg.name!r} (features "
                f"{list(cfg.feature_names)}); plan every table of the module (the planners "
                "do), e.g. with BagPipeShardingPlanner or bagpipe_plan(module, world_size)"
            )
        if ps.compute_kernel == BAGPIPE_KERNEL:
            check_bagpipe_table(cfg, ps, where)
            ours.append(cfg)
        else:
            stock.append(cfg)
    return ours, stock


def check_bagpipe_table(cfg: BaseEmbeddingConfig, ps: ParameterSharding, where: str) -> None:
    """Refuses a BagPipe placement BagPipe cannot serve (ValueError naming the table and
    what to change)."""
    if ps.sharding_type != ShardingType.DATA_PARALLEL.value:
        raise ValueError(
            f"{where}: table {cfg.name!r} is planned on the BagPipe kernel with sharding type "
            f"{ps.sharding_type!r}; BagPipe places the compute data-parallel (rows live in "
            "the PS): plan it 'data_parallel', or give it a stock compute kernel"
        )
    if cfg.data_type != DataType.FP32:
        raise ValueError(
            f"{where}: table {cfg.name!r} has data type {cfg.data_type}; BagPipe trains FP32 "
            "tables only: make it FP32 or keep it on a stock TorchRec kernel "
            "(ParameterConstraints(compute_kernels=[...]) without 'customized_kernel')"
        )
    pooling = getattr(cfg, "pooling", None)
    if isinstance(cfg, EmbeddingBagConfig) and pooling not in (PoolingType.SUM, PoolingType.MEAN):
        raise ValueError(
            f"{where}: table {cfg.name!r} uses {pooling} pooling; BagPipe supports SUM and "
            "MEAN: change the pooling or keep the table on a stock TorchRec kernel"
        )


def table_specs(configs: Sequence[BaseEmbeddingConfig],
                optimizers: Mapping[str, TableOptimizer]) -> list[TableSpec]:
    """The tables of `configs` in order, with their optimizers and learning rates (by table:
    `table_optimizer.table_optimizer`)."""
    return [
        TableSpec(
            name=cfg.name,
            num_embeddings=int(cfg.num_embeddings),
            dim=int(cfg.embedding_dim),
            feature_names=tuple(cfg.feature_names),
            pooling="mean" if getattr(cfg, "pooling", None) == PoolingType.MEAN else "sum",
            lr=optimizers[cfg.name].lr,
            init_max=float(cfg.get_weight_init_max()),
            optimizer=optimizers[cfg.name].spec,
            eviction=eviction_spec_of(cfg, 1),
        )
        for cfg in configs
    ]


def session_table_name(session: int, fqn: str, index: int, dim: int) -> str:
    """The PS table name of a fused table: unique per job, 1-128 chars of [A-Za-z0-9_.:-]."""
    safe = re.sub(r"[^A-Za-z0-9_.:-]", "_", fqn or "ebc")
    tail = f"-f{index}-d{dim}"
    head = f"s{session}:"
    room = 128 - len(head) - len(tail)
    if len(safe) > room:
        digest = hashlib.blake2b(safe.encode(), digest_size=6).hexdigest()
        safe = safe[: room - len(digest) - 1] + "_" + digest
    return head + safe + tail


class FusedLayout:
    """Tables, slots and fused tables of one module, and the KJT -> fused keys mapping.

    Args:
        tables: the module's tables, in order (`table_specs`).
        embedding_names: per table, its features' output keys
            (TorchRec's `get_embedding_names_by_table`).
        session: the job's session number for this module (unique per job).
        module_fqn: the module's path in the model ("" for the root).
        weighted: whether the module takes per-id weights (an unweighted module drops a
            KJT's weights).
    """

    def __init__(self, tables: Sequence[TableSpec], embedding_names: Sequence[Sequence[str]],
                 *, session: int, module_fqn: str, weighted: bool, where: str = "BagPipe module"
                 ) -> None:
        self.tables: list[TableSpec] = list(tables)
        self._weighted = weighted
        self._where = where
        self._table_by_name = {t.name: t for t in self.tables}
        self.slots: list[SlotSpec] = []
        for t, names in zip(self.tables, embedding_names):
            for feature, key in zip(t.feature_names, names):
                self.slots.append(SlotSpec(len(self.slots), t.name, feature, key, t.dim))

        # Tables of one dim, optimizer and learning rate share a key space (one param group);
        # virtual tables only with virtual tables of the same eviction rule.
        by_group: dict[tuple[int, Any, float, Any], list[TableSpec]] = {}
        for t in self.tables:
            by_group.setdefault((t.dim, t.optimizer, t.lr, t.eviction), []).append(t)
        self.fused: list[FusedTableSpec] = []
        for i, ((dim, optimizer, lr, eviction), members) in enumerate(by_group.items()):
            offsets: dict[str, int] = {}
            total = 0
            for t in members:
                offsets[t.name] = total
                total += t.num_embeddings
            names = {t.name for t in members}
            self.fused.append(FusedTableSpec(
                name=session_table_name(session, module_fqn, i, dim),
                dim=dim, lr=lr, tables=members, offsets=offsets, num_keys=total,
                slots=[s for s in self.slots if s.table in names], optimizer=optimizer,
                eviction=eviction,
            ))
        self._group_of_table = {
            t.name: g for g, spec in enumerate(self.fused) for t in spec.tables
        }
        # Per fused table: per-slot key offset and id bound (CPU tensors, slot order).
        self._slot_offsets = [
            torch.tensor([spec.offsets[s.table] for s in spec.slots], dtype=torch.int64)
            for spec in self.fused
        ]
        self._slot_limits = [
            torch.tensor([self._table_by_name[s.table].num_embeddings for s in spec.slots],
                         dtype=torch.int64)
            for spec in self.fused
        ]
        self._perms: dict[tuple[str, ...], list[list[int] | None]] = {}

    # ---- tables -------------------------------------------------------------------------------
    def table(self, name: str) -> TableSpec:
        return self._table_by_name[name]

    def group_of(self, table: str) -> int:
        """The index of the fused table holding `table`."""
        return self._group_of_table[table]

    def fused_start(self, table: str) -> int:
        """The fused key of `table`'s row 0."""
        return self.fused[self._group_of_table[table]].offsets[table]

    # ---- KJT -> fused keys --------------------------------------------------------------------
    def split(self, features: KeyedJaggedTensor
              ) -> tuple[list[KeyedJaggedTensor], list[torch.Tensor]]:
        """Per fused table: the KJT permuted into slot order and its validated fused keys
        (1-D int64, CPU)."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"{self._where} expects a KeyedJaggedTensor, got {type(features).__name__}"
            )
        if features.variable_stride_per_key():
            names = [t.name for t in self.tables]
            raise ValueError(
                f"{self._where}: the KJT has a variable batch size per feature (VBE), but "
                f"tables {names} are on BagPipe, which takes one batch size for every "
                "feature: pass a KJT with one stride, or keep these tables on stock TorchRec "
                "kernels (ParameterConstraints(compute_kernels=[...]) without "
                "'customized_kernel')"
            )
        check_kjt(features)
        if self._weighted and features.weights_or_none() is None:
            raise ValueError(f"{self._where} is weighted but the KJT has no weights")
        perms = self._perms.get(tuple(features.keys()))
        if perms is None:
            perms = self.permutations(features.keys())
        per_group: list[KeyedJaggedTensor] = []
        keys: list[torch.Tensor] = []
        for g, perm in enumerate(perms):
            kjt = features if perm is None else features.permute(perm)
            if not self._weighted and kjt.weights_or_none() is not None:
                kjt = KeyedJaggedTensor(
                    keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                    offsets=kjt.offsets(), stride=kjt.stride(),
                )
            per_group.append(kjt)
            keys.append(self.fused_keys(g, kjt))
        return per_group, keys

    def permutations(self, kjt_keys: list[str]) -> list[list[int] | None]:
        """Per fused table: the KJT permutation into slot order (None: the KJT already is in
        that order, with no extra keys). Cached per key order."""
        index = {k: i for i, k in enumerate(kjt_keys)}
        perms: list[list[int] | None] = []
        for spec in self.fused:
            try:
                perm = [index[s.feature] for s in spec.slots]
            except KeyError as e:
                raise ValueError(
                    f"the KJT has no feature {e.args[0]!r} (needed by table "
                    f"{next(s.table for s in spec.slots if s.feature == e.args[0])!r}); "
                    f"its keys are {kjt_keys}"
                ) from None
            perms.append(None if perm == list(range(len(kjt_keys))) else perm)
        if len(self._perms) < _MAX_CACHED_KEY_ORDERS:
            self._perms[tuple(kjt_keys)] = perms
        return perms

    def fused_keys(self, g: int, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """The fused keys of `kjt` (already in fused table `g`'s slot order); every id is
        checked against its table's range."""
        ids = kjt.values().to("cpu", torch.int64)
        counts = torch.tensor(kjt.length_per_key(), dtype=torch.int64)
        limits = torch.repeat_interleave(self._slot_limits[g], counts, output_size=ids.numel())
        bad = (ids < 0) | (ids >= limits)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0].item())
            slot_i = int(torch.searchsorted(torch.cumsum(counts, 0), pos, right=True).item())
            slot = self.fused[g].slots[slot_i]
            n = self._table_by_name[slot.table].num_embeddings
            raise ValueError(
                f"feature {slot.feature!r} of table {slot.table!r} has id {int(ids[pos])} "
                f"outside [0, {n})"
            )
        offsets = torch.repeat_interleave(self._slot_offsets[g], counts, output_size=ids.numel())
        return ids + offsets

    # ---- output -----------------------------------------------------------------------------
    @property
    def grouped_slots(self) -> list[SlotSpec]:
        """The slots in the order the fused tables produce them (fused table by fused table,
        each in module order)."""
        return [s for spec in self.fused for s in spec.slots]
