"""Planning BagPipe tables with TorchRec's planner, or by hand.

* `BagPipeShardingPlanner` is a drop-in for `EmbeddingShardingPlanner` (same constructor,
  `plan`, `collective_plan`). It first places every table of every EmbeddingBagCollection /
  EmbeddingCollection a BagPipe sharder serves (placement.py: `ParameterConstraints` force
  either side; otherwise tables over `BagPipeConfig.placement_min_rows` rows or
  `placement_memory_fraction` of a rank's device memory go to BagPipe, the rest keep stock
  TorchRec sharding), then runs TorchRec's planner with each table constrained to its side:
  BagPipe tables data-parallel on the BagPipe kernel, stock tables on the stock kernels
  (what TorchRec's own planner would choose for them). When the stock tables do not fit,
  the largest unforced ones move to BagPipe and it plans again. Its estimators accept the
  BagPipe kernel and charge only the cache and its metadata to device memory (the rows live
  in the PS); every other sharding option goes to TorchRec's own estimators. The plan's
  module plans print where each table's rows live (`str(plan)`, TorchRec's plan table);
  `last_placements` says why.
* `bagpipe_plan(module, world_size, stock=...)` builds a plan by hand, without the planner:
  every table on BagPipe, except those `stock` maps to one of TorchRec's
  `ParameterShardingGenerator`s (`table_wise(rank=0)`, `row_wise()`, `data_parallel()`...).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping

import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    PlannerError,
    PlannerErrorType,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.sharding_plan import ParameterShardingGenerator
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.placement import (
    BagPipeModuleShardingPlan,
    TablePlacement,
    decide_placement,
    embedding_modules,
    move_largest,
    placement_constraints,
    table_configs,
)
from torchrec_bagpipe.distributed.sharder import METADATA_BYTES_PER_ROW, _BagPipeSharder
from torchrec_bagpipe.distributed.table_optimizer import state_floats
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL
from torchrec_bagpipe.distributed.virtual_tables import planned_rows

__all__ = [
    "BagPipeParameterSharding",
    "BagPipePerfEstimator",
    "BagPipeShardingPlanner",
    "BagPipeStorageEstimator",
    "bagpipe_parameter_sharding",
    "bagpipe_plan",
]

# Bytes of one int64 id and of a fp32 value.
_ID_BYTES = 8
_FP32_BYTES = 4


@dataclasses.dataclass
class BagPipeParameterSharding(ParameterSharding):
    """A ParameterSharding naming the BagPipe kernel (for table `table`).

    TorchRec's stock sharders ask a customized-kernel sharding for extra fused params
    before they build their kernels; answering with an error turns a DMP built without the
    BagPipe sharders into a clear failure instead of a confusing one.
    """

    table: str | None = None

    def get_additional_fused_params(self) -> dict[str, object]:
        named = f"table {self.table!r}" if self.table else "a table"
        raise ValueError(
            f"this sharding plan places {named} on the BagPipe kernel ('customized_kernel'), "
            "but its module is being sharded by TorchRec's stock sharder: build "
            "DistributedModelParallel with sharders=bagpipe_sharders(config) "
            "(BagPipeEmbeddingBagCollectionSharder, BagPipeEmbeddingCollectionSharder)"
        )


def bagpipe_parameter_sharding(world_size: int, ranks: list[int] | None = None,
                               table: str | None = None) -> BagPipeParameterSharding:
    """The ParameterSharding of one BagPipe table: compute on every rank, rows in the PS."""
    return BagPipeParameterSharding(
        sharding_type=ShardingType.DATA_PARALLEL.value,
        compute_kernel=BAGPIPE_KERNEL,
        ranks=list(ranks) if ranks is not None else list(range(world_size)),
        table=table,
    )


def bagpipe_plan(
    module: nn.Module,
    world_size: int | None = None,
    stock: Mapping[str, ParameterShardingGenerator] | None = None,
    *,
    local_size: int | None = None,
    device_type: str = "cpu",
) -> ShardingPlan:
    """A hand-built plan for every EmbeddingBagCollection and EmbeddingCollection in `module`
    (keys are module paths, as DMP expects; `module` itself may be one): every table on
    BagPipe, except the tables `stock` names, planned by TorchRec's generator given for
    each (e.g. `{"small": table_wise(rank=0), "dp": data_parallel()}`)."""
    if world_size is None:
        if not dist.is_initialized():
            raise ValueError("bagpipe_plan needs world_size when torch.distributed is not set up")
        world_size = dist.get_world_size()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    stock = dict(stock or {})
    plan: dict[str, EmbeddingModuleShardingPlan] = {}
    for path, child in embedding_modules(module):
        names = [cfg.name for cfg in table_configs(child)]
        ours = {n: bagpipe_parameter_sharding(world_size, table=n) for n in names
                if n not in stock}
        theirs = {n: g for n, g in stock.items() if n in names}
        module_plan: dict[str, ParameterSharding] = dict(ours)
        if theirs:
            sharder: ModuleSharder[nn.Module] = (  # type: ignore[assignment]
                EmbeddingBagCollectionSharder() if isinstance(child, EmbeddingBagCollection)
                else EmbeddingCollectionSharder())
            params = sharder.shardable_parameters(child)
            for n, generate in theirs.items():
                module_plan[n] = generate(params[n], local_size or world_size, world_size,
                                          device_type, sharder)
        plan[path] = BagPipeModuleShardingPlan({n: module_plan[n] for n in names})
    if not plan:
        raise ValueError(
            "bagpipe_plan: the module has no EmbeddingBagCollection or EmbeddingCollection")
    unknown = sorted(set(stock) - {n for p in plan.values() for n in p})
    if unknown:
        raise ValueError(f"bagpipe_plan: stock names tables the module does not have: {unknown}")
    return ShardingPlan(plan)  # type: ignore[arg-type]


class _SplitEstimator(ShardEstimator):
    """Runs TorchRec's `_STOCK` estimator on stock sharding options and `_estimate` on
    BagPipe ones."""

    _STOCK: type[ShardEstimator]

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        config: BagPipeConfig | None = None,
        bagpipe_tables: set[str] | None = None,
    ) -> None:
        self._topology = topology
        self._config = config if config is not None else BagPipeConfig()
        self._stock = self._STOCK(topology, constraints)
        # The tables placed on BagPipe (None: every table), which fuse by dim.
        self._bagpipe_tables = bagpipe_tables

    @abc.abstractmethod
    def _estimate(self, so: ShardingOption, sharder_data_map=None) -> None:
        """Fills `so`'s shards' estimate (storage or perf) for a BagPipe table."""

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:  # type: ignore[override]
        rest = [so for so in sharding_options if so.compute_kernel != BAGPIPE_KERNEL]
        if rest:
            self._stock.estimate(rest, sharder_data_map=sharder_data_map)
        for so in sharding_options:
            if so.compute_kernel == BAGPIPE_KERNEL:
                self._estimate(so, sharder_data_map)


def _fused_rows(so: ShardingOption, bagpipe_tables: set[str] | None) -> int:
    """Rows of the fused table `so`'s table joins (its module's same-dim BagPipe tables)."""
    dim = int(so.tensor.shape[1])
    try:
        configs = table_configs(so.module[1])
    except AssertionError:  # not a collection: the table alone
        return int(so.tensor.shape[0])
    return sum(
        planned_rows(c) for c in configs
        if int(c.embedding_dim) == dim
        and (bagpipe_tables is None or c.name in bagpipe_tables or c.name == so.name)
    )


def _cache_rows(so: ShardingOption, config: BagPipeConfig,
                bagpipe_tables: set[str] | None) -> float:
    """This table's share of its fused table's cache rows."""
    fused = max(1, _fused_rows(so, bagpipe_tables))
    rows = min(fused, config.cache_rows(fused))
    own = next((planned_rows(c) for c in _configs_of(so) if c.name == so.name),
               int(so.tensor.shape[0]))
    return rows * own / fused


def _configs_of(so: ShardingOption) -> list:
    try:
        return list(table_configs(so.module[1]))
    except AssertionError:
        return []


def _lookups(so: ShardingOption) -> float:
    """Ids one rank looks up per batch for this table."""
    return float(so.batch_size) * float(sum(so.input_lengths))


class BagPipeStorageEstimator(_SplitEstimator):
    """Device memory of a BagPipe table: its cache share, metadata and batch tensors."""

    _STOCK = EmbeddingStorageEstimator

    def _estimate(self, so: ShardingOption, sharder_data_map=None) -> None:
        dim = int(so.tensor.shape[1])
        # A cached row holds its optimizer state too (the sharder's fused_params or the
        # table's in-backward optimizer say which).
        sharder_data = (sharder_data_map or {}).get(so.module_type_key)
        fused_params = getattr(sharder_data, "fused_params", None)
        state = state_floats(so.tensor, fused_params, dim, f"BagPipe table {so.name!r}")
        cache = (_cache_rows(so, self._config, self._bagpipe_tables)
                 * ((dim + state) * _FP32_BYTES + METADATA_BYTES_PER_ROW))
        lookups = _lookups(so)
        # Ids in, the gathered unique rows (at most one per id) and the pooled output.
        batch = lookups * (_ID_BYTES + dim * _FP32_BYTES) + so.batch_size * dim * _FP32_BYTES
        # The prepared-batch queue holds that many batches' gathered rows.
        total = int(cache + batch * (1 + self._config.prepared_batches))
        on_hbm = self._topology.compute_device == "cuda"
        for shard in so.shards:
            shard.storage = Storage(hbm=total if on_hbm else 0, ddr=0 if on_hbm else total)


class BagPipePerfEstimator(_SplitEstimator):
    """Per-batch time of a BagPipe table: pooling on the device plus the row traffic to the
    PS for the expected misses (prefetch overlaps it with compute; charged as comms)."""

    _STOCK = EmbeddingPerfEstimator

    def _estimate(self, so: ShardingOption, sharder_data_map=None) -> None:
        dim = int(so.tensor.shape[1])
        lookups = _lookups(so)
        bw = (
            self._topology.hbm_mem_bw
            if self._topology.compute_device == "cuda"
            else self._topology.ddr_mem_bw
        )
        compute = lookups * dim * _FP32_BYTES / bw
        fraction = min(1.0, _cache_rows(so, self._config, self._bagpipe_tables)
                       / max(1, int(so.tensor.shape[0])))
        misses = lookups * (1.0 - fraction)
        row_traffic = misses * (dim * _FP32_BYTES + _ID_BYTES)
        fwd_comms = row_traffic / CROSS_NODE_BANDWIDTH
        # Backward sends each unique row's gradient once (bounded by the lookups).
        bwd_comms = lookups * (dim * _FP32_BYTES + _ID_BYTES) / CROSS_NODE_BANDWIDTH
        perf = Perf(
            fwd_compute=compute,
            fwd_comms=fwd_comms,
            bwd_compute=compute * self._topology.bwd_compute_multiplier,
            bwd_comms=bwd_comms,
        )
        for shard in so.shards:
            shard.perf = perf


# TorchRec's planner errors that mean the stock tables did not fit in the ranks' memory.
_NO_FIT = (PlannerErrorType.INSUFFICIENT_STORAGE, PlannerErrorType.STRICT_CONSTRAINTS,
           PlannerErrorType.PARTITION)


class BagPipeShardingPlanner(EmbeddingShardingPlanner):
    """EmbeddingShardingPlanner that places each table on BagPipe or stock TorchRec
    sharding, then plans both (see module docstring).

    Same constructor as `EmbeddingShardingPlanner`, plus `config` (defaults to the config
    of the first BagPipe sharder passed to `plan`): the placement thresholds and the cache
    size the estimates charge. A user-given `enumerator` is used as is (it must accept the
    BagPipe kernel and apply the planner's constraints itself).
    """

    # Planning attempts after the stock tables did not fit (each moves more tables).
    _MAX_REPLANS = 8

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator=None,
        storage_reservation=None,
        proposer=None,
        partitioner=None,
        performance_model=None,
        stats=None,
        constraints: dict[str, ParameterConstraints] | None = None,
        debug: bool = True,
        callbacks=None,
        timeout_seconds: int | None = None,
        plan_loader=None,
        *,
        config: BagPipeConfig | None = None,
    ) -> None:
        super().__init__(
            topology=topology,
            batch_size=batch_size,
            enumerator=enumerator,
            storage_reservation=storage_reservation,
            proposer=proposer,
            partitioner=partitioner,
            performance_model=performance_model,
            stats=stats,
            constraints=constraints,
            debug=debug,
            callbacks=callbacks,
            timeout_seconds=timeout_seconds,
            plan_loader=plan_loader,
        )
        self._user_constraints = dict(constraints) if constraints else {}
        self._user_enumerator = enumerator
        self._bagpipe_config = config
        self.last_placements: list[TablePlacement] = []

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        ours = [s for s in sharders if isinstance(s, _BagPipeSharder)]
        config = self._bagpipe_config or (ours[0].config if ours else BagPipeConfig())
        placements = decide_placement(
            embedding_modules(module), {s.module_type for s in ours},
            self._user_constraints, config, self._topology,
        )
        moved = 0
        for attempt in range(self._MAX_REPLANS + 1):
            try:
                plan = self._plan_placed(module, sharders, placements, config)
                break
            except PlannerError as e:
                if e.error_type not in _NO_FIT or attempt == self._MAX_REPLANS:
                    raise
                moved = max(1, 2 * moved)
                again = move_largest(placements, moved)
                if again == placements:
                    raise
                placements = again
        self.last_placements = placements
        return plan

    def _plan_placed(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]],
                     placements: list[TablePlacement], config: BagPipeConfig) -> ShardingPlan:
        constraints = placement_constraints(placements, self._user_constraints)
        self._constraints = constraints or None
        if self._user_enumerator is None:
            on_bagpipe = {p.table for p in placements if p.bagpipe}
            self._enumerator = EmbeddingEnumerator(
                topology=self._topology,
                batch_size=self._batch_size,
                constraints=self._constraints,
                estimator=[
                    BagPipePerfEstimator(self._topology, self._constraints, config, on_bagpipe),
                    BagPipeStorageEstimator(self._topology, self._constraints, config,
                                            on_bagpipe),
                ],
            )
        plan = super().plan(module, sharders)
        served = {p.module for p in placements}
        for path, module_plan in list(plan.plan.items()):
            fixed = {
                name: (bagpipe_parameter_sharding(self._topology.world_size, ps.ranks, name)
                       if ps.compute_kernel == BAGPIPE_KERNEL else ps)
                for name, ps in module_plan.items()  # type: ignore[attr-defined]
            }
            if path in served:
                plan.plan[path] = BagPipeModuleShardingPlan(fixed)
            else:
                module_plan.update(fixed)  # type: ignore[attr-defined]
        return plan
