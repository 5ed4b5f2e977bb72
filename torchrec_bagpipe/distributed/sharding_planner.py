"""Planning BagPipe tables with TorchRec's planner, or by hand.

* `BagPipeShardingPlanner` is a drop-in for `EmbeddingShardingPlanner` (same constructor,
  `plan`, `collective_plan`). It first places every table of every EmbeddingBagCollection /
  EmbeddingCollection a BagPipe sharder serves by the placement rule (placement.py
  `place_table`, the rule TorchRec's own planner follows too: constraints, capability, the
  opt-in size rule, BagPipe first), then runs TorchRec's planner with each table constrained
  to its side: BagPipe tables data-parallel on the BagPipe kernel, stock tables on the stock
  kernels (what TorchRec's own planner would choose for them). When every table is on
  BagPipe it writes the plan itself (nothing to choose) after checking the caches fit. When
  the stock tables do not fit, the largest unforced ones move to BagPipe and it plans again.
  Its estimators (estimators.py) charge a BagPipe table only its cache and metadata (the
  rows live in the PS); every other sharding option goes to TorchRec's own estimators. The
  plan's module plans print where each table's rows live and why (`str(plan)`, TorchRec's
  plan table); `last_placements` holds the same.
* `bagpipe_plan(module, world_size, stock=...)` builds a plan by hand, without the planner:
  every table on BagPipe, except those `stock` maps to one of TorchRec's
  `ParameterShardingGenerator`s (`table_wise(rank=0)`, `row_wise()`, `data_parallel()`...);
  plan_helpers.py's `bagpipe()` is the generator for TorchRec's own helpers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlannerError,
    PlannerErrorType,
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
from torchrec_bagpipe.distributed.estimators import (
    BagPipePerfEstimator,
    BagPipeStorageEstimator,
)
from torchrec_bagpipe.distributed.placement import (
    BagPipeModuleShardingPlan,
    TablePlacement,
    decide_placement,
    embedding_modules,
    move_largest,
    placement_constraints,
    table_configs,
)
from torchrec_bagpipe.distributed.sharder import _BagPipeSharder
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL

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
            embedding_modules(module), {s.module_type: s.fused_params for s in ours},
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
        options = self._enumerator.enumerate(module, sharders)  # cached for super().plan
        if options and all(so.compute_kernel == BAGPIPE_KERNEL for so in options):
            return self._bagpipe_only(module, sharders, options, placements)
        plan = super().plan(module, sharders)
        served = {p.module for p in placements}
        for path, module_plan in list(plan.plan.items()):
            fixed = {
                name: (bagpipe_parameter_sharding(self._topology.world_size, ps.ranks, name)
                       if ps.compute_kernel == BAGPIPE_KERNEL else ps)
                for name, ps in module_plan.items()  # type: ignore[attr-defined]
            }
            if path in served:
                reasons = {p.table: p.reason for p in placements if p.module == path}
                plan.plan[path] = BagPipeModuleShardingPlan(fixed, reasons=reasons)
            else:
                module_plan.update(fixed)  # type: ignore[attr-defined]
        return plan

    def _bagpipe_only(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]],
                      options: list[ShardingOption], placements: list[TablePlacement]
                      ) -> ShardingPlan:
        """The plan when every table is on BagPipe: nothing for TorchRec's planner to choose
        (each table is data-parallel on the BagPipe kernel), so it is written here, after
        checking that the tables' caches fit in every rank's memory left by the storage
        reservation (TorchRec's planner would also log a warning for each data-parallel
        table: its plan has no sharding spec)."""
        world = self._topology.world_size
        left = self._storage_reservation.reserve(
            topology=self._topology, batch_size=self._batch_size, module=module,
            sharders=sharders, constraints=self._constraints)
        used = [Storage(hbm=0, ddr=0) for _ in range(world)]
        for so in options:
            for rank, shard in enumerate(so.shards):
                if shard.storage is not None:
                    used[rank] = used[rank] + shard.storage
        for rank, device in enumerate(left.devices):
            if not used[rank].fits_in(device.storage):
                raise PlannerError(
                    error_type=PlannerErrorType.INSUFFICIENT_STORAGE,
                    message=f"BagPipe tables' caches need {used[rank]} on rank {rank}, which "
                            f"has {device.storage} after the storage reservation")
        for so in options:  # data-parallel: one shard per rank
            for rank, shard in enumerate(so.shards):
                shard.rank = rank
        self._search_space = options
        self._best_plan = options
        plan: dict[str, EmbeddingModuleShardingPlan] = {}
        for p in placements:
            module_plan = plan.setdefault(p.module, BagPipeModuleShardingPlan())
            module_plan[p.table] = bagpipe_parameter_sharding(world, list(range(world)), p.table)
            module_plan.reasons[p.table] = p.reason  # type: ignore[attr-defined]
        return ShardingPlan(plan)  # type: ignore[arg-type]
