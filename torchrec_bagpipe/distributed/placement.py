"""Per-table placement: which tables of a model go to BagPipe and which keep TorchRec's
stock sharding, why, and how a plan shows it.

`place_table` is THE rule, used by both planners: `BagPipeShardingPlanner`
(sharding_planner.py, through `decide_placement`, before TorchRec's planner runs) and
TorchRec's own `EmbeddingShardingPlanner` (estimators.py, through the perf estimates of the
sharding options). For every table of every EmbeddingBagCollection / EmbeddingCollection
that a BagPipe sharder serves, in order:

1. constraint: `ParameterConstraints` decide first, both ways: `compute_kernels` naming only
   `customized_kernel` (with `sharding_types` allowing `data_parallel`) forces BagPipe;
   `compute_kernels` without it, or `sharding_types` without `data_parallel`, forces stock.
2. capability: a table TorchRec's stock fused kernels cannot train on the planned device
   (capability.py: fused Adam on CPU, BF16 weights on CPU) goes to BagPipe when BagPipe can
   serve it; when neither can, a ValueError names the table, the optimizer and the device.
3. size (opt-in): with `BagPipeConfig.placement_min_rows` and/or
   `placement_memory_fraction` set, a table with at least that many rows, or whose weights
   exceed that fraction of one rank's device memory, goes to BagPipe; the others stay stock.
4. BagPipe first: otherwise every table BagPipe can serve (FP32; SUM/MEAN pooling; an
   optimizer the PS applies) goes to BagPipe; one it cannot serve stays stock.
5. did not fit: when TorchRec's planner then finds the stock tables do not fit in the ranks'
   memory, `BagPipeShardingPlanner` moves the largest unforced ones to BagPipe and plans
   again (`move_largest`).

Tables of modules no BagPipe sharder serves are not placed (TorchRec plans them); a
constraint forcing BagPipe on one is an error naming the table and the sharder to pass.

`BagPipeModuleShardingPlan` is TorchRec's per-module plan with columns saying where each
table's rows live and why; `str(plan)` prints it in TorchRec's plan table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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
from torchrec_bagpipe.distributed.capability import stock_cannot_train, table_emb_optimizer
from torchrec_bagpipe.distributed.table_optimizer import UnsupportedOptimizerError, table_optimizer
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL
from torchrec_bagpipe.distributed.virtual_tables import virtual_placement

__all__ = [
    "BagPipeModuleShardingPlan",
    "TablePlacement",
    "decide_placement",
    "embedding_modules",
    "move_largest",
    "place_table",
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


def place_table(
    cfg: BaseEmbeddingConfig,
    constraint: ParameterConstraints | None,
    config: BagPipeConfig,
    device: str,
    budget: int | None,
    optimizer: str | None,
    bagpipe_optimizer_error: str | None,
    where: str,
) -> tuple[bool, bool, str]:
    """THE placement rule of one table a BagPipe sharder serves, for both planners:
    (on BagPipe, forced by its constraint, reason). In order: constraints, capability, the
    opt-in size rule, BagPipe first. `optimizer`: the EmbOptimType name the stock kernels
    would build (capability.table_emb_optimizer); `bagpipe_optimizer_error`: why BagPipe
    cannot apply the table's optimizer, or None; `budget`: one rank's device memory (the size
    rule's fraction; None: no fraction rule). ValueError naming the table for a placement
    that cannot be."""
    bagpipe_ok, stock_ok = _sides(constraint)
    if not bagpipe_ok and not stock_ok:
        raise ValueError(
            f"{where}: its ParameterConstraints allow no placement (the BagPipe kernel "
            f"'{BAGPIPE_KERNEL}' is data-parallel, but sharding_types are "
            f"{constraint.sharding_types})"  # type: ignore[union-attr]
        )
    unsupported = bagpipe_unsupported(cfg) or bagpipe_optimizer_error
    virtual = virtual_placement(cfg, where, bagpipe_ok, unsupported)  # issue 22
    if virtual is not None:
        return virtual
    cannot = stock_cannot_train(cfg, optimizer, device)
    if not stock_ok:  # 1. constraints
        if unsupported is not None:
            raise ValueError(
                f"{where}: its ParameterConstraints force the BagPipe kernel, but BagPipe "
                f"cannot serve its {unsupported}; drop the constraint or change the table")
        return True, True, "constraint: ParameterConstraints name the BagPipe kernel"
    if cannot is not None:  # 2. capability
        if not bagpipe_ok or unsupported is not None:
            why = ("its ParameterConstraints exclude the BagPipe kernel" if not bagpipe_ok
                   else f"BagPipe cannot serve its {unsupported}")
            raise ValueError(
                f"{where}: neither side can train it with optimizer "
                f"{(optimizer or 'default').lower()} on {device}: {cannot}, and {why}")
        return True, False, f"capability: {cannot}"
    if not bagpipe_ok:
        return False, True, "constraint: ParameterConstraints exclude the BagPipe kernel"
    if unsupported is not None:
        return False, False, f"BagPipe cannot serve its {unsupported}"
    rows, size = int(cfg.num_embeddings), table_bytes(cfg)
    min_rows, fraction = config.placement_min_rows, config.placement_memory_fraction
    if fraction is not None and budget is None:
        raise ValueError("placement_memory_fraction needs the ranks' device memory")
    if min_rows is not None and rows >= min_rows:  # 3. size (opt-in)
        return True, False, f"size: {rows} rows >= placement_min_rows {min_rows}"
    if fraction is not None and size > fraction * budget:  # type: ignore[operator]
        return True, False, (f"size: {size / budget:.2%} of a rank's device memory > "  # type: ignore[operator]
                             f"placement_memory_fraction {fraction:.2%}")
    if min_rows is not None or fraction is not None:
        share = f", {size / budget:.2%} of a rank's device memory" if budget else ""
        return False, False, f"size: {rows} rows{share} (below the size rule)"
    return True, False, "BagPipe first (no size rule set)"  # 4. BagPipe


def table_bytes(cfg: BaseEmbeddingConfig) -> int:
    """The bytes of a table's weights."""
    return (int(cfg.num_embeddings) * int(cfg.embedding_dim)
            * torch.empty(0, dtype=data_type_to_dtype(cfg.data_type)).element_size())


def module_table_facts(module: nn.Module, fused_params: Mapping[str, Any] | None
                       ) -> dict[str, tuple[BaseEmbeddingConfig, str | None, str | None]]:
    """Per table of an EmbeddingBagCollection / EmbeddingCollection: (config, the stock
    kernels' optimizer name, why BagPipe cannot apply its optimizer or None)."""
    params = dict(module.named_parameters())
    prefix = "embedding_bags" if isinstance(module, EmbeddingBagCollection) else "embeddings"
    out = {}
    for cfg in table_configs(module):
        param = params.get(f"{prefix}.{cfg.name}.weight")
        try:
            table_optimizer(param, fused_params, f"table {cfg.name!r}")
            error = None
        except UnsupportedOptimizerError as e:
            error = f"optimizer ({e})"
        except ValueError:  # no learning rate yet: BagPipe's check comes when sharding
            error = None
        out[cfg.name] = (cfg, table_emb_optimizer(param, fused_params), error)
    return out


def decide_placement(
    modules: Iterable[tuple[str, nn.Module]],
    served: Mapping[type[nn.Module], Mapping[str, Any] | None],
    constraints: Mapping[str, ParameterConstraints],
    config: BagPipeConfig,
    topology: Topology,
) -> list[TablePlacement]:
    """The placement of every table of `modules` whose type a BagPipe sharder serves
    (`served`: module type -> that sharder's fused_params), in model order (`place_table`).
    ValueError naming the table for a placement that cannot be."""
    budget = device_memory(topology)
    out: list[TablePlacement] = []
    for path, module in modules:
        facts = (module_table_facts(module, served[type(module)])
                 if type(module) in served else {})
        for cfg in table_configs(module):
            c = constraints.get(cfg.name)
            where = f"table {cfg.name!r} of {type(module).__name__} {path or '<root>'}"
            if type(module) not in served:
                if not _sides(c)[1]:
                    raise ValueError(
                        f"{where}: its ParameterConstraints name the BagPipe kernel, but no "
                        f"BagPipe sharder serves {type(module).__name__}: pass "
                        f"BagPipe{type(module).__name__}Sharder (or bagpipe_sharders(config)) "
                        "to the planner and to DistributedModelParallel"
                    )
                continue
            _, optimizer, opt_error = facts[cfg.name]
            placed, forced, reason = place_table(cfg, c, config, topology.compute_device,
                                                 budget, optimizer, opt_error, where)
            servable = bagpipe_unsupported(cfg) is None and opt_error is None
            out.append(TablePlacement(path, cfg.name, int(cfg.num_embeddings),
                                      int(cfg.embedding_dim), table_bytes(cfg), placed,
                                      forced, servable, reason))
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
        dataclasses.replace(p, bagpipe=True, reason="did not fit: the stock tables did not "
                            "fit in the ranks' memory, moved to BagPipe largest first")
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
    """TorchRec's plan of one module, printed with columns saying where each table's rows
    live (`BagPipe PS`: the BagPipe kernel, `trainers`: a stock TorchRec sharding) and why
    (`reasons`, table -> the placement rule's reason, when the planner placed it)."""

    def __init__(self, *args: Any, reasons: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reasons: dict[str, str] = dict(reasons or {})

    def __str__(self) -> str:
        params = [
            [name, ps.sharding_type, ps.compute_kernel,
             "BagPipe PS" if ps.compute_kernel == BAGPIPE_KERNEL else "trainers",
             str(ps.ranks), self.reasons.get(name, "plan")]
            for name, ps in self.items()
        ]
        shards = [
            [name, str(shard.shard_offsets), str(shard.shard_sizes), str(shard.placement)]
            for name, ps in self.items()
            for shard in (getattr(ps.sharding_spec, "shards", None) or [])
        ]
        out = "\n\n" + _tabulate(
            params, ["param", "sharding type", "compute kernel", "rows in", "ranks",  # type: ignore[arg-type]
                     "why"])
        out += "\n\n" + _tabulate(
            shards, ["param", "shard offsets", "shard sizes", "placement"])  # type: ignore[arg-type]
        return out
