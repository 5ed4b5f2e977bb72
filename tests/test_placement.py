"""Per-table placement by BagPipeShardingPlanner (one process, `meta` modules): the default
size rule, ParameterConstraints forcing either side, agreement with TorchRec's own planner
on the stock tables, the fallback when stock tables do not fit, the printed plan, hand
plans with stock tables, and the errors of impossible placements."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import data_parallel, row_wise, table_wise
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed import (
    BAGPIPE_KERNEL,
    BagPipeEmbeddingBagCollectionSharder,
    BagPipeEmbeddingCollectionSharder,
    BagPipeShardingPlanner,
    bagpipe_plan,
    bagpipe_sharders,
)
from torchrec_bagpipe.distributed.sharding_planner import BagPipeParameterSharding

META = torch.device("meta")
LR = {"learning_rate": 0.1}
# One rank's memory in these tests: 1 MB of DDR (the size rule's budget).
MB = 1 << 20


def _ebc(sizes: dict[str, int], dim: int = 8, dtype: DataType = DataType.FP32
         ) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=r,
                                   feature_names=[f"f_{n}"], data_type=dtype)
                for n, r in sizes.items()],
        device=META,
    )


class _Model(torch.nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection, ec: EmbeddingCollection | None = None
                 ) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec


# The size rule these tests use (opt-in: unset, every table BagPipe can serve goes there).
SIZE_RULE = BagPipeConfig(placement_memory_fraction=0.01)


def _planner(ddr: int = MB, world: int = 2, **kwargs) -> BagPipeShardingPlanner:
    kwargs.setdefault("config", SIZE_RULE)
    return BagPipeShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu", ddr_cap=ddr),
        batch_size=8, **kwargs)


def _placed(plan, path: str) -> dict[str, bool]:
    return {n: ps.compute_kernel == BAGPIPE_KERNEL for n, ps in plan.plan[path].items()}


def test_default_placement_by_size_and_min_rows():
    # 8-dim fp32 rows are 32 bytes: 1% of 1 MB is 10486 bytes, i.e. 327 rows.
    sizes = {"huge": 20_000, "large": 400, "medium": 300, "tiny": 4}
    sharder = BagPipeEmbeddingBagCollectionSharder(fused_params=LR)
    planner = _planner()
    plan = planner.plan(_ebc(sizes), [sharder])
    assert _placed(plan, "") == {"huge": True, "large": True, "medium": False, "tiny": False}
    for name in ("huge", "large"):
        ps = plan.plan[""][name]
        assert isinstance(ps, BagPipeParameterSharding) and ps.table == name
        assert ps.sharding_type == "data_parallel" and ps.ranks == [0, 1]
    assert {p.table: p.bagpipe for p in planner.last_placements} == _placed(plan, "")
    assert "placement_memory_fraction" in planner.last_placements[0].reason
    # A larger fraction keeps more tables stock; placement_min_rows adds tables by rows.
    config = BagPipeConfig(placement_memory_fraction=0.1, placement_min_rows=300)
    plan = _planner(config=config).plan(_ebc(sizes), [sharder])
    assert _placed(plan, "") == {"huge": True, "large": True, "medium": True, "tiny": False}
    config = BagPipeConfig(placement_memory_fraction=1.0)
    plan = _planner(config=config).plan(_ebc(sizes), [sharder])
    assert not any(_placed(plan, "").values())
    # The sharder's config is the default.
    plan = _planner(config=None).plan(_ebc(sizes), [BagPipeEmbeddingBagCollectionSharder(
        BagPipeConfig(placement_min_rows=0), LR)])
    assert all(_placed(plan, "").values())
    # No size rule: BagPipe first.
    planner = _planner(config=BagPipeConfig())
    plan = planner.plan(_ebc(sizes), [sharder])
    assert all(_placed(plan, "").values())
    assert all(p.reason.startswith("BagPipe first") for p in planner.last_placements)


def test_constraints_force_either_side():
    sizes = {"huge": 20_000, "huge2": 20_000, "tiny": 4, "tiny2": 4}
    constraints = {
        # BagPipe for a small table; stock for a large one, by kernel or by sharding type.
        "tiny": ParameterConstraints(compute_kernels=[BAGPIPE_KERNEL]),
        "huge": ParameterConstraints(compute_kernels=["fused"]),
        "huge2": ParameterConstraints(sharding_types=["table_wise"]),
        # Both sides allowed: the size rule decides (stock for a tiny table).
        "tiny2": ParameterConstraints(compute_kernels=[BAGPIPE_KERNEL, "dense"]),
    }
    planner = _planner(constraints=constraints)
    plan = planner.plan(_ebc(sizes), [BagPipeEmbeddingBagCollectionSharder(fused_params=LR)])
    assert _placed(plan, "") == {"huge": False, "huge2": False, "tiny": True, "tiny2": False}
    assert plan.plan[""]["huge"].compute_kernel == "fused"
    assert plan.plan[""]["huge2"].sharding_type == "table_wise"
    forced = {p.table: p.forced for p in planner.last_placements}
    assert forced == {"huge": True, "huge2": True, "tiny": True, "tiny2": False}


def test_stock_tables_are_planned_as_torchrecs_planner_plans_them():
    big = {f"big{i}": 30_000 for i in range(3)}
    small = {"s0": 200, "s1": 150, "s2": 100, "s3": 50, "s4": 20}
    ours = _planner().plan(_ebc({**big, **small}),
                           [BagPipeEmbeddingBagCollectionSharder(fused_params=LR)])
    assert _placed(ours, "") == {**{n: True for n in big}, **{n: False for n in small}}
    theirs = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu", ddr_cap=MB), batch_size=8,
    ).plan(_ebc(small), [BagPipeEmbeddingBagCollectionSharder(fused_params=LR)._stock()])
    for name in small:
        a, b = ours.plan[""][name], theirs.plan[""][name]
        assert (a.sharding_type, a.compute_kernel, a.ranks) == \
            (b.sharding_type, b.compute_kernel, b.ranks), name


def test_stock_tables_that_do_not_fit_move_to_bagpipe_largest_first():
    # fraction 1.0: no table is large enough for the size rule, but the three stock tables
    # (75 KB each) do not fit in two ranks of 100 KB: the largest move to BagPipe.
    sizes = {"a": 2_400, "b": 2_300, "c": 2_200, "d": 10}
    planner = _planner(ddr=100_000, config=BagPipeConfig(placement_memory_fraction=1.0))
    plan = planner.plan(_ebc(sizes), [BagPipeEmbeddingBagCollectionSharder(fused_params=LR)])
    placed = _placed(plan, "")
    assert placed["a"] and not placed["d"]
    moved = [p.table for p in planner.last_placements if p.bagpipe]
    assert moved == sorted(moved, key=lambda t: -sizes[t])
    assert all("did not fit" in p.reason for p in planner.last_placements if p.bagpipe)


def test_embedding_collections_are_placed_and_the_plan_prints_where_rows_live():
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=r,
                                feature_names=[f"g_{n}"])
                for n, r in {"seq_big": 20_000, "seq_small": 10}.items()],
        device=META,
    )
    model = _Model(_ebc({"huge": 20_000, "tiny": 4}), ec)
    plan = _planner().plan(model, bagpipe_sharders(fused_params=LR))  # type: ignore[arg-type]
    assert _placed(plan, "ebc") == {"huge": True, "tiny": False}
    assert _placed(plan, "ec") == {"seq_big": True, "seq_small": False}
    text = str(plan)
    assert "rows in" in text and "BagPipe PS" in text and "trainers" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("seq_big "))
    assert "customized_kernel" in line and "BagPipe PS" in line
    # Without the EC sharder, ECs are TorchRec's: not placed, and no BagPipe kernel (its
    # unsharded weights then count as dense memory: a larger rank).
    planner = _planner(ddr=64 * MB, config=BagPipeConfig(placement_min_rows=1000))
    plan = planner.plan(model, [BagPipeEmbeddingBagCollectionSharder(fused_params=LR)])
    assert _placed(plan, "ebc") == {"huge": True, "tiny": False} and "ec" not in plan.plan
    assert {p.module for p in planner.last_placements} == {"ebc"}


def test_impossible_placements_are_refused_naming_the_table():
    sharders = [BagPipeEmbeddingBagCollectionSharder(fused_params=LR)]
    force = {"t": ParameterConstraints(compute_kernels=[BAGPIPE_KERNEL])}
    with pytest.raises(ValueError, match=r"'t'.*FP16.*FP32"):
        _planner(constraints=force).plan(_ebc({"t": 100}, dtype=DataType.FP16), sharders)
    # Not forced: a table BagPipe cannot serve stays stock, whatever its size.
    planner = _planner()
    plan = planner.plan(_ebc({"t": 10_000}, dtype=DataType.FP16), sharders)
    assert not _placed(plan, "")["t"] and "FP32" in planner.last_placements[0].reason
    nothing = {"t": ParameterConstraints(compute_kernels=[BAGPIPE_KERNEL],
                                         sharding_types=["table_wise"])}
    with pytest.raises(ValueError, match=r"'t'.*allow no placement"):
        _planner(constraints=nothing).plan(_ebc({"t": 100}), sharders)
    # The BagPipe kernel on a module no BagPipe sharder serves.
    ec = EmbeddingCollection(tables=[EmbeddingConfig(
        name="t", embedding_dim=8, num_embeddings=10, feature_names=["g"])], device=META)
    with pytest.raises(ValueError, match=r"'t'.*BagPipeEmbeddingCollectionSharder"):
        _planner(constraints=force).plan(_Model(_ebc({"u": 10}), ec), sharders)


def test_hand_plans_with_stock_tables():
    ebc = _ebc({"a": 100, "b": 100, "c": 100, "d": 100})
    ec = EmbeddingCollection(tables=[EmbeddingConfig(
        name="e", embedding_dim=8, num_embeddings=40, feature_names=["g"])], device=META)
    plan = bagpipe_plan(_Model(ebc, ec), 2, stock={
        "b": data_parallel(), "c": table_wise(rank=1, compute_kernel="fused"),
        "d": row_wise(compute_kernel="fused")})
    assert _placed(plan, "ebc") == {"a": True, "b": False, "c": False, "d": False}
    assert list(plan.plan["ebc"]) == ["a", "b", "c", "d"]
    assert plan.plan["ebc"]["c"].ranks == [1] and plan.plan["ebc"]["d"].sharding_type == \
        "row_wise"
    assert _placed(plan, "ec") == {"e": True}
    with pytest.raises(ValueError, match="'zz'"):
        bagpipe_plan(ebc, 2, stock={"zz": data_parallel()})
    # The plan of a BagPipe table refuses TorchRec's stock sharders, naming the table.
    with pytest.raises(ValueError, match=r"table 'a'.*bagpipe_sharders"):
        plan.plan["ebc"]["a"].get_additional_fused_params()


def test_ec_sharder_offers_the_bagpipe_kernel_next_to_torchrecs():
    sharder = BagPipeEmbeddingCollectionSharder(BagPipeConfig(lookahead=2), LR)
    assert sharder.module_type is EmbeddingCollection
    assert sharder.compute_kernels("data_parallel", "cpu")[0] == BAGPIPE_KERNEL
    assert BAGPIPE_KERNEL not in sharder.compute_kernels("row_wise", "cpu")
    assert sharder.sharding_types("cpu") == sharder._stock().sharding_types("cpu")
    both = bagpipe_sharders(BagPipeConfig(lookahead=3))
    assert [s.module_type for s in both] == [EmbeddingBagCollection, EmbeddingCollection]
    assert all(s.config.lookahead == 3 for s in both)
    with pytest.raises(ValueError, match="placement_memory_fraction"):
        BagPipeConfig(placement_memory_fraction=1.5)
    with pytest.raises(ValueError, match="placement_min_rows"):
        BagPipeConfig(placement_min_rows=-1)
