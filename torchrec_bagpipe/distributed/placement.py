"""Per-table placement: which tables of a model go to BagPipe and which keep TorchRec's
stock sharding, and how a plan shows it.

`BagPipeShardingPlanner` (sharding_planner.py) calls `decide_placement` before TorchRec's
planner runs, then constrains each table to its side. For every table of every
EmbeddingBagCollection / EmbeddingCollection that a BagPipe sharder serves:

1. `ParameterConstraints` decide first, both ways: `compute_kernels` naming only
   `customized_kernel` (with `sharding_types` allowing `data_parallel`) forces BagPipe;
   `compute_kernels` without it, or `sharding_types` without `data_parallel`, forces stock.
   A table BagPipe cannot serve (not FP32; pooling other than SUM/MEAN) stays stock unless
   forced, and forcing it is an error naming the table.
2. Otherwise the table's size decides: BagPipe when it has at least
   `BagPipeConfig.placement_min_rows` rows (when set), or when its weights exceed
   `BagPipeConfig.placement_memory_fraction` of one rank's device memory (the topology's
   smallest HBM on CUDA, DDR on CPU); small tables stay stock.
3. When TorchRec's planner then finds the stock tables do not fit in the ranks' memory, the
   planner moves the largest unforced stock tables to BagPipe and plans again
   (`move_largest`).

Tables of modules no BagPipe sharder serves are not placed (TorchRec plans them); a
constraint forcing BagPipe on one is an error naming the table and the sharder to pass.

`BagPipeModuleShardingPlan` is TorchRec's per-module plan with a column saying where each
table's rows live; `str(plan)` prints it in TorchRec's plan table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.enumerators import GUARDED_COMPUTE_KERNELS
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ShardingType,
    _tabulate,
)
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    PoolingType,
    data_type_to_dtype,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL
from torchrec_bagpipe.distributed.virtual_tables import virtual_placement

__all__ = [
    "BagPipeModuleShardingPlan",
    "TablePlacement",
    "decide_placement",
    "embedding_modules",
    "move_largest",
    "placement_constraints",
    "table_configs",
]

DP = ShardingType.DATA_PARALLEL.value


@dataclass(frozen=True)
class TablePlacement:
    """Where one table's rows live, and why."""

    module: str  # the module's path in the model
    table: str
    rows: int
    dim: int
    bytes: int
    bagpipe: bool
    forced: bool  # by ParameterConstraints
    servable: bool  # BagPipe can serve it (FP32; SUM or MEAN pooling)
    reason: str


def embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost EmbeddingBagCollections and EmbeddingCollections of `model` (exact types,
    as DMP routes them), by path ("" for the model itself)."""
    found: list[tuple[str, nn.Module]] = []

    def visit(path: str, m: nn.Module) -> None:
        if type(m) in (EmbeddingBagCollection, EmbeddingCollection):
            found.append((path, m))
            return
        for name, child in m.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return found


def table_configs(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """The table configs of an EmbeddingBagCollection or EmbeddingCollection."""
    if isinstance(module, EmbeddingBagCollection):
        return list(module.embedding_bag_configs())
    assert isinstance(module, EmbeddingCollection)
    return list(module.embedding_configs())


def bagpipe_unsupported(cfg: BaseEmbeddingConfig) -> str | None:
    """Why BagPipe cannot serve table `cfg`, or None."""
    if cfg.data_type != DataType.FP32:
        return f"data type {cfg.data_type.value} (BagPipe trains FP32 tables)"
    pooling = getattr(cfg, "pooling", None)
    if isinstance(cfg, EmbeddingBagConfig) and pooling not in (PoolingType.SUM,
                                                               PoolingType.MEAN):
        return f"{pooling} pooling (BagPipe pools SUM and MEAN)"
    return None


def _sides(c: ParameterConstraints | None) -> tuple[bool, bool]:
    """(BagPipe allowed, stock allowed) by a table's constraints."""
    if c is None:
        return True, True
    kernels = c.compute_kernels
    types = c.sharding_types
    bagpipe = (kernels is None or BAGPIPE_KERNEL in kernels) and (types is None or DP in types)
    stock = kernels is None or any(k != BAGPIPE_KERNEL for k in kernels)
    return bagpipe, stock


def device_memory(topology: Topology) -> int:
    """One rank's device memory: the smallest device's HBM on CUDA, DDR otherwise."""
    tier = "hbm" if topology.compute_device == "cuda" else "ddr"
    return min(int(getattr(d.storage, tier)) for d in topology.devices)


def decide_placement(
    modules: Iterable[tuple[str, nn.Module]],
    served: set[type[nn.Module]],
    constraints: Mapping[str, ParameterConstraints],
    config: BagPipeConfig,
    topology: Topology,
) -> list[TablePlacement]:
    """The placement of every table of `modules` whose type a BagPipe sharder serves
    (`served`), in model order (see module docstring). ValueError naming the table for a
    placement the constraints force but that cannot be."""
    budget = device_memory(topology)
    out: list[TablePlacement] = []
    for path, module in modules:
        for cfg in table_configs(module):
            c = constraints.get(cfg.name)
            bagpipe_ok, stock_ok = _sides(c)
            where = f"table {cfg.name!r} of {type(module).__name__} {path or '<root>'}"
            if not bagpipe_ok and not stock_ok:
                raise ValueError(
                    f"{where}: its ParameterConstraints allow no placement (the BagPipe kernel "
                    f"'{BAGPIPE_KERNEL}' is data-parallel, but sharding_types are "
                    f"{c.sharding_types})"  # type: ignore[union-attr]
                )
            if type(module) not in served:
                if not stock_ok:
                    raise ValueError(
                        f"{where}: its ParameterConstraints name the BagPipe kernel, but no "
                        f"BagPipe sharder serves {type(module).__name__}: pass "
                        f"BagPipe{type(module).__name__}Sharder (or bagpipe_sharders(config)) "
                        "to the planner and to DistributedModelParallel"
                    )
                continue
            rows, dim = int(cfg.num_embeddings), int(cfg.embedding_dim)
            size = rows * dim * torch.empty(0, dtype=data_type_to_dtype(cfg.data_type)
                                            ).element_size()
            unsupported = bagpipe_unsupported(cfg)
            virtual = virtual_placement(cfg, where, bagpipe_ok, unsupported)  # issue 22
            if virtual is not None:
                placed, forced, reason = virtual
            elif not stock_ok:
                if unsupported is not None:
                    raise ValueError(
                        f"{where}: its ParameterConstraints force the BagPipe kernel, but "
                        f"BagPipe cannot serve its {unsupported}; drop the constraint or "
                        "change the table"
                    )
                placed, forced, reason = True, True, "ParameterConstraints"
            elif not bagpipe_ok:
                placed, forced, reason = False, True, "ParameterConstraints"
            elif unsupported is not None:
                placed, forced, reason = False, False, unsupported
            elif config.placement_min_rows is not None and rows >= config.placement_min_rows:
                placed, forced, reason = True, False, (
                    f"{rows} rows >= placement_min_rows {config.placement_min_rows}")
            elif size > config.placement_memory_fraction * budget:
                placed, forced, reason = True, False, (
                    f"{size / budget:.2%} of a rank's device memory > "
                    f"placement_memory_fraction {config.placement_memory_fraction:.2%}")
            else:
                placed, forced, reason = False, False, (
                    f"{size / budget:.2%} of a rank's device memory")
            out.append(TablePlacement(path, cfg.name, rows, dim, size, placed, forced,
                                      unsupported is None, reason))
    return out


def move_largest(placements: list[TablePlacement], count: int) -> list[TablePlacement]:
    """`placements` with the `count` largest unforced stock tables BagPipe can serve moved
    to BagPipe (the stock tables did not fit); unchanged when there are none."""
    movable = sorted(
        (p for p in placements if not p.bagpipe and not p.forced and p.servable),
        key=lambda p: p.bytes, reverse=True,
    )[:count]
    chosen = {(p.module, p.table) for p in movable}
    return [
        dataclasses.replace(p, bagpipe=True, reason="the stock tables did not fit in the "
                            "ranks' memory: moved to BagPipe, largest first")
        if (p.module, p.table) in chosen else p
        for p in placements
    ]


def placement_constraints(
    placements: Iterable[TablePlacement],
    constraints: Mapping[str, ParameterConstraints],
) -> dict[str, ParameterConstraints]:
    """The user's constraints with each placed table restricted to its side: BagPipe tables
    to data-parallel on the BagPipe kernel, stock tables to the stock kernels."""
    out = dict(constraints)
    # TorchRec's default kernels (its enumerator's, when a table names none), less ours.
    stock_kernels = [k.value for k in EmbeddingComputeKernel
                     if k not in GUARDED_COMPUTE_KERNELS and k.value != BAGPIPE_KERNEL]
    for p in placements:
        given = constraints.get(p.table)
        base = given if given is not None else ParameterConstraints()
        if p.bagpipe:
            out[p.table] = dataclasses.replace(base, sharding_types=[DP],
                                               compute_kernels=[BAGPIPE_KERNEL])
        else:
            kernels = base.compute_kernels
            out[p.table] = dataclasses.replace(
                base, compute_kernels=[k for k in (kernels or stock_kernels)
                                       if k != BAGPIPE_KERNEL])
    return out


class BagPipeModuleShardingPlan(EmbeddingModuleShardingPlan):
    """TorchRec's plan of one module, printed with a column saying where each table's rows
    live: `BagPipe PS` (the BagPipe kernel) or `trainers` (a stock TorchRec sharding)."""

    def __str__(self) -> str:
        params = [
            [name, ps.sharding_type, ps.compute_kernel,
             "BagPipe PS" if ps.compute_kernel == BAGPIPE_KERNEL else "trainers",
             str(ps.ranks)]
            for name, ps in self.items()
        ]
        shards = [
            [name, str(shard.shard_offsets), str(shard.shard_sizes), str(shard.placement)]
            for name, ps in self.items()
            for shard in (getattr(ps.sharding_spec, "shards", None) or [])
        ]
        out = "\n\n" + _tabulate(
            params, ["param", "sharding type", "compute kernel", "rows in", "ranks"])  # type: ignore[arg-type]
        out += "\n\n" + _tabulate(
            shards, ["param", "shard offsets", "shard sizes", "placement"])  # type: ignore[arg-type]
        return out
