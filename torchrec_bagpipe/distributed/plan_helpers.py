"""A BagPipe generator for TorchRec's plan helpers.

`torchrec.distributed.sharding_plan.construct_module_sharding_plan(module, {table:
generator})` builds a module's plan from per-table generators (`data_parallel()`,
`table_wise(rank=...)`, `row_wise()`, ...); `bagpipe()` is one more, so hand-written plans
mix BagPipe and stock tables in one module::

    plan = construct_module_sharding_plan(ebc, {"big": bagpipe(), "small": table_wise(rank=0)},
                                          sharder=BagPipeEmbeddingBagCollectionSharder())
    model = DistributedModelParallel(model, device, plan=ShardingPlan({"ebc": plan}),
                                     sharders=bagpipe_sharders())

Pass a BagPipe sharder as `sharder` (TorchRec's default sharder for the module type would
build the stock tables' kernels from TorchRec's own sharder, which is the same). A plan
naming `bagpipe()` given to DMP without the BagPipe sharders fails with an error naming them
(`BagPipeParameterSharding`).
"""

from __future__ import annotations

from torch import nn
from torchrec.distributed.sharding_plan import ParameterShardingGenerator
from torchrec.distributed.types import ModuleSharder, ParameterSharding

from torchrec_bagpipe.distributed.sharding_planner import bagpipe_parameter_sharding

__all__ = ["bagpipe"]


def bagpipe() -> ParameterShardingGenerator:
    """A `ParameterShardingGenerator` placing a table on BagPipe: data-parallel compute on
    every rank, rows in the PS, the BagPipe kernel."""

    def _generate(param: nn.Parameter, local_size: int, world_size: int, device_type: str,
                  sharder: ModuleSharder[nn.Module]) -> ParameterSharding:
        return bagpipe_parameter_sharding(world_size)

    return _generate
