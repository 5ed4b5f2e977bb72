"""Planning BagPipe tables with TorchRec's planner, or by hand.

* `BagPipeShardingPlanner` is a drop-in for `EmbeddingShardingPlanner` (same constructor,
  `plan`, `collective_plan`). Every table of an EmbeddingBagCollection served by a
  `BagPipeEmbeddingBagCollectionSharder` is planned data-parallel on the BagPipe kernel
  unless a `ParameterConstraints` entry for the table names its compute kernels (then the
  stock choice among those is kept). Its estimators accept the BagPipe kernel and charge
  only the cache and its metadata to device memory (the rows live in the PS); every other
  sharding option goes to TorchRec's own estimators.
* `bagpipe_plan(module, world_size)` builds the same plan by hand, without the planner.
"""

from __future__ import annotations

import abc
import copy
import dataclasses

import torch.distributed as dist
from torch import nn
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
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.sharder import (
    _METADATA_BYTES_PER_ROW,
    BagPipeEmbeddingBagCollectionSharder,
)
from torchrec_bagpipe.distributed.table_optimizer import state_floats
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
    """A ParameterSharding naming the BagPipe kernel.

    TorchRec's stock EBC sharder asks a customized-kernel sharding for extra fused params
    before it builds its kernels; answering with an error turns a DMP built without the
    BagPipe sharder into a clear failure instead of a confusing one.
    """

    def get_additional_fused_params(self) -> dict[str, object]:
        raise ValueError(
            "this sharding plan places tables on the BagPipe kernel ('customized_kernel'), "
            "but the EmbeddingBagCollection is being sharded by TorchRec's stock sharder: "
            "build DistributedModelParallel with "
            "sharders=[BagPipeEmbeddingBagCollectionSharder(...)]"
        )


def bagpipe_parameter_sharding(world_size: int, ranks: list[int] | None = None
                               ) -> BagPipeParameterSharding:
    """The ParameterSharding of one BagPipe table: compute on every rank, rows in the PS."""
    return BagPipeParameterSharding(
        sharding_type=ShardingType.DATA_PARALLEL.value,
        compute_kernel=BAGPIPE_KERNEL,
        ranks=list(ranks) if ranks is not None else list(range(world_size)),
    )


def bagpipe_plan(module: nn.Module, world_size: int | None = None) -> ShardingPlan:
    """A hand-built plan placing every table of every EmbeddingBagCollection in `module`
    on BagPipe (keys are module paths, as DMP expects; `module` itself may be an EBC)."""
    if world_size is None:
        if not dist.is_initialized():
            raise ValueError("bagpipe_plan needs world_size when torch.distributed is not set up")
        world_size = dist.get_world_size()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    plan: dict[str, EmbeddingModuleShardingPlan] = {}
    for path, child in _ebcs(module):
        module_plan = EmbeddingModuleShardingPlan()
        for cfg in child.embedding_bag_configs():
            module_plan[cfg.name] = bagpipe_parameter_sharding(world_size)
        plan[path] = module_plan
    if not plan:
        raise ValueError("bagpipe_plan: the module has no EmbeddingBagCollection")
    return ShardingPlan(plan)  # type: ignore[arg-type]


def _ebcs(module: nn.Module) -> list[tuple[str, EmbeddingBagCollection]]:
    """Outermost EmbeddingBagCollections of `module`, by path (children of an EBC skipped)."""
    found: list[tuple[str, EmbeddingBagCollection]] = []

    def visit(path: str, m: nn.Module) -> None:
        if type(m) is EmbeddingBagCollection:
            found.append((path, m))
            return
        for name, child in m.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", module)
    return found


class _SplitEstimator(ShardEstimator):
    """Runs TorchRec's `_STOCK` estimator on stock sharding options and `_estimate` on
    BagPipe ones."""

    _STOCK: type[ShardEstimator]

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        config: BagPipeConfig | None = None,
    ) -> None:
        self._topology = topology
        self._config = config if config is not None else BagPipeConfig()
        self._stock = self._STOCK(topology, constraints)

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


def _fused_rows(so: ShardingOption) -> int:
    """Rows of the fused table `so`'s table joins (same-dim tables of its EBC)."""
    module = so.module[1]
    dim = int(so.tensor.shape[1])
    if isinstance(module, EmbeddingBagCollection):
        return sum(
            int(c.num_embeddings) for c in module.embedding_bag_configs()
            if int(c.embedding_dim) == dim
        )
    return int(so.tensor.shape[0])


def _cache_rows(so: ShardingOption, config: BagPipeConfig) -> float:
    """This table's share of its fused table's cache rows."""
    fused = max(1, _fused_rows(so))
    rows = min(fused, config.cache_rows(fused))
    return rows * int(so.tensor.shape[0]) / fused


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
        cache = _cache_rows(so, self._config) * ((dim + state) * _FP32_BYTES
                                                 + _METADATA_BYTES_PER_ROW)
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
        fraction = min(1.0, _cache_rows(so, self._config) / max(1, int(so.tensor.shape[0])))
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


class BagPipeShardingPlanner(EmbeddingShardingPlanner):
    """EmbeddingShardingPlanner that plans BagPipe tables (see module docstring).

    Same constructor as `EmbeddingShardingPlanner`, plus `config` (defaults to the config
    of the BagPipe sharder passed to `plan`) used to size the caches in estimates.
    """

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

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        ours = [s for s in sharders if isinstance(s, BagPipeEmbeddingBagCollectionSharder)]
        config = self._bagpipe_config or (ours[0].config if ours else BagPipeConfig())
        constraints = dict(self._user_constraints)
        if ours:
            for _, ebc in _ebcs(module):
                for cfg in ebc.embedding_bag_configs():
                    given = constraints.get(cfg.name)
                    if given is not None and given.compute_kernels:
                        continue  # the user chose this table's kernels
                    base = copy.copy(given) if given is not None else ParameterConstraints()
                    constraints[cfg.name] = dataclasses.replace(
                        base,
                        sharding_types=[ShardingType.DATA_PARALLEL.value],
                        compute_kernels=[BAGPIPE_KERNEL],
                    )
        self._constraints = constraints or None
        if self._user_enumerator is None:
            self._enumerator = EmbeddingEnumerator(
                topology=self._topology,
                batch_size=self._batch_size,
                constraints=self._constraints,
                estimator=[
                    BagPipePerfEstimator(self._topology, self._constraints, config),
                    BagPipeStorageEstimator(self._topology, self._constraints, config),
                ],
            )
        plan = super().plan(module, sharders)
        for module_plan in plan.plan.values():
            for name, ps in list(module_plan.items()):  # type: ignore[attr-defined]
                if ps.compute_kernel == BAGPIPE_KERNEL and not isinstance(
                    ps, BagPipeParameterSharding
                ):
                    module_plan[name] = bagpipe_parameter_sharding(  # type: ignore[index]
                        self._topology.world_size, ps.ranks
                    )
        return plan

