"""The one-line swap's planning side (one process, `meta` modules): TorchRec's own planner
(the one DMP builds when given no plan, or one the user builds) and BagPipeShardingPlanner
make the same placement by one rule, whatever the enumeration order; capability-aware
placement; the reasons `print(plan)` shows; TorchRec's plan helpers with `bagpipe()`; the
package replaces nothing of TorchRec's; a BagPipe plan without the BagPipe sharders fails
naming them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator import (
    EmbeddingPerfEstimatorConfig,
    EmbeddingPerfEstimatorFactory,
)
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed import (
    BAGPIPE_KERNEL,
    BagPipeEmbeddingBagCollectionSharder,
    BagPipeShardingPlanner,
    bagpipe,
    bagpipe_sharders,
)
from torchrec_bagpipe.distributed.estimators import PENALTY_MS, BagPipeAwarePerfConfig
from torchrec_bagpipe.distributed.sharding_planner import BagPipeParameterSharding

META = torch.device("meta")
LR = {"learning_rate": 0.1}
ROWS = {"t0": 10, "t1": 200, "t2": 5_000, "t3": 100_000}


class _Model(torch.nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec


def _model() -> _Model:
    bags = [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=r,
                               feature_names=[f"f_{n}"]) for n, r in ROWS.items()]
    bags.append(EmbeddingBagConfig(name="fp16", embedding_dim=8, num_embeddings=3_000,
                                   feature_names=["f_fp16"], data_type=DataType.FP16))
    seqs = [EmbeddingConfig(name=f"s{n}", embedding_dim=8, num_embeddings=r,
                            feature_names=[f"g_{n}"]) for n, r in ROWS.items()]
    return _Model(EmbeddingBagCollection(tables=bags, device=META),
                  EmbeddingCollection(tables=seqs, device=META))


def _topology(device: str = "cpu") -> Topology:
    # TorchRec's default capacities (what DMP's own planner assumes).
    return Topology(world_size=2, compute_device=device)


def _kernels(plan) -> dict[str, tuple[str, str]]:
    return {n: (ps.sharding_type, ps.compute_kernel)
            for module_plan in plan.plan.values() for n, ps in module_plan.items()}


def _on_bagpipe(plan) -> set[str]:
    return {n for n, (_, k) in _kernels(plan).items() if k == BAGPIPE_KERNEL}


class _StockKernelsFirst(BagPipeEmbeddingBagCollectionSharder):
    """Offers the BagPipe kernel after TorchRec's (another enumeration order)."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)
        return [k for k in kernels if k != BAGPIPE_KERNEL] + [
            k for k in kernels if k == BAGPIPE_KERNEL]


CONFIGS = {
    "bagpipe_first": (BagPipeConfig(), {"t0", "t1", "t2", "t3"}),
    "min_rows": (BagPipeConfig(placement_min_rows=1_000), {"t2", "t3"}),
    # 1e-6 of 128 GB is 137 KB: 4295 rows of 32 bytes.
    "fraction": (BagPipeConfig(placement_memory_fraction=1e-6), {"t2", "t3"}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_torchrecs_planner_and_ours_make_the_same_placement(name):
    config, expected = CONFIGS[name]
    sharders = bagpipe_sharders(config, fused_params=LR)
    ours = BagPipeShardingPlanner(topology=_topology(), batch_size=32).plan(_model(), sharders)
    theirs = EmbeddingShardingPlanner(topology=_topology(), batch_size=32).plan(
        _model(), sharders)
    # The same tables on BagPipe (the EC's as the EBC's); the FP16 table stays stock.
    assert _on_bagpipe(ours) == _on_bagpipe(theirs) == expected | {f"s{t}" for t in expected}
    # Every stock table on the same stock sharding type and kernel.
    stock = set(_kernels(ours)) - expected - {f"s{t}" for t in expected}
    assert {n: _kernels(ours)[n] for n in stock} == {n: _kernels(theirs)[n] for n in stock}
    # Whatever order TorchRec enumerates modules and kernels in.
    topo = _topology()
    reordered = EmbeddingShardingPlanner(
        topology=topo, batch_size=32,
        enumerator=EmbeddingEnumerator(topology=topo, batch_size=32,
                                       use_exact_enumerate_order=True),
    ).plan(_model(), [_StockKernelsFirst(config, LR), sharders[1]])
    assert _on_bagpipe(reordered) == _on_bagpipe(theirs)


def test_torchrecs_planner_keeps_its_own_estimates_and_constraints():
    # A stock option's perf is TorchRec's default config's, to the last bit.
    model = _model()
    planner = EmbeddingShardingPlanner(topology=_topology(), batch_size=32)
    sharders = bagpipe_sharders(BagPipeConfig(placement_min_rows=1_000), fused_params=LR)
    planner.plan(model, sharders)
    options = planner.get_search_space()
    assert options
    torchrec = EmbeddingPerfEstimatorFactory.create_with_config(
        EmbeddingPerfEstimatorConfig(), topology=_topology())
    stock = [so for so in options if so.compute_kernel != BAGPIPE_KERNEL
             and so.name in ("t0", "t1", "fp16")]
    ours = [[s.perf for s in so.shards] for so in stock]
    torchrec.estimate(stock, planner._enumerator._sharder_data_map)
    assert ours == [[s.perf for s in so.shards] for so in stock]
    # The BagPipe option of a stock table carries the penalty; a BagPipe table's does not.
    by = {(so.name, so.compute_kernel): so for so in options}
    assert by[("t0", BAGPIPE_KERNEL)].total_perf >= PENALTY_MS
    assert by[("t3", BAGPIPE_KERNEL)].total_perf < PENALTY_MS
    assert EmbeddingPerfEstimatorFactory._registry["default_estimator"] is \
        BagPipeAwarePerfConfig
    # ParameterConstraints: TorchRec applies them itself (the rule's side is then absent).
    constraints = {"t3": ParameterConstraints(sharding_types=["table_wise"]),
                   "t0": ParameterConstraints(compute_kernels=[BAGPIPE_KERNEL])}
    planner = EmbeddingShardingPlanner(topology=_topology(), batch_size=32,
                                       constraints=constraints)
    plan = planner.plan(_model(), sharders)
    assert _kernels(plan)["t3"][0] == "table_wise" and "t0" in _on_bagpipe(plan)
    # A table left one side keeps TorchRec's own estimates (no penalty), so it cannot mask
    # the penalties of the others (the rating is the busiest rank's).
    assert all(so.total_perf < PENALTY_MS for so in planner.get_search_space()
               if so.name in ("t3", "t0"))
    assert _on_bagpipe(plan) == _on_bagpipe(BagPipeShardingPlanner(
        topology=_topology(), batch_size=32, constraints=constraints).plan(_model(), sharders))


def _adam_ec(dtype: DataType = DataType.FP32) -> EmbeddingCollection:
    return EmbeddingCollection(tables=[
        EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=r, feature_names=[f"g_{n}"],
                        data_type=dtype)
        for n, r in {"small": 20, "big": 50_000}.items()], device=META)


def test_capability_sends_what_stock_cannot_train_to_bagpipe():
    adam = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01, "weight_decay": 0.1,
            "weight_decay_mode": WeightDecayMode.L2}
    # The size rule alone would keep both tables stock.
    config = BagPipeConfig(placement_min_rows=10**6)
    for planner_cls in (BagPipeShardingPlanner, EmbeddingShardingPlanner):
        sharders = bagpipe_sharders(config, fused_params=adam)
        plan = planner_cls(topology=_topology("cpu"), batch_size=32).plan(_adam_ec(), sharders)
        assert _on_bagpipe(plan) == {"small", "big"}, planner_cls
        # On CUDA the stock kernels run Adam: the size rule decides.
        plan = planner_cls(topology=_topology("cuda"), batch_size=32).plan(
            _adam_ec(), sharders)
        assert _on_bagpipe(plan) == set(), planner_cls
    planner = BagPipeShardingPlanner(topology=_topology("cpu"), batch_size=32)
    plan = planner.plan(_adam_ec(), bagpipe_sharders(config, fused_params=adam))
    assert all(p.reason.startswith("capability: ") and "adam" in p.reason and "cpu" in p.reason
               for p in planner.last_placements)
    # In-backward Adam on an EBC's table, as TorchRec maps it.
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="b", embedding_dim=8, num_embeddings=30, feature_names=["f"])], device=META)
    ebc.embedding_bags["b"].weight._optimizer_classes = [torch.optim.Adam]
    ebc.embedding_bags["b"].weight._optimizer_kwargs = [{"lr": 0.01}]
    plan = BagPipeShardingPlanner(topology=_topology("cpu"), batch_size=32).plan(
        ebc, bagpipe_sharders(config))
    assert _on_bagpipe(plan) == {"b"}
    # Neither side can: BF16 weights on CPU (BagPipe trains FP32) - an error naming all.
    for planner_cls in (BagPipeShardingPlanner, EmbeddingShardingPlanner):
        with pytest.raises(ValueError, match=r"'small'.*adam.*cpu"):
            planner_cls(topology=_topology("cpu"), batch_size=32).plan(
                _adam_ec(DataType.BF16), bagpipe_sharders(config, fused_params=adam))


def test_print_plan_says_why_each_table_went_where_it_did():
    constraints = {"t1": ParameterConstraints(compute_kernels=[BAGPIPE_KERNEL]),
                   "st3": ParameterConstraints(compute_kernels=["fused"])}
    planner = BagPipeShardingPlanner(topology=_topology(), batch_size=32,
                                     constraints=constraints)
    plan = planner.plan(_model(), bagpipe_sharders(BagPipeConfig(placement_min_rows=1_000),
                                                   fused_params=LR))
    text = str(plan)
    lines: dict[str, str] = {}
    for ln in text.splitlines():  # the params table comes first, then the shards'
        if ln.split():
            lines.setdefault(ln.split()[0], ln)
    assert "why" in text
    assert "constraint" in lines["t1"] and "BagPipe PS" in lines["t1"]
    assert "constraint" in lines["st3"] and "trainers" in lines["st3"]
    assert "size" in lines["t0"] and "trainers" in lines["t0"]
    assert "size" in lines["t3"] and "BagPipe PS" in lines["t3"]
    assert "FP16" in lines["fp16"]
    reasons = {p.table: p.reason for p in planner.last_placements}
    assert all(reasons[n] in lines[n] for n in reasons)
    # collective_plan broadcasts the plan pickled: the reasons travel with it.
    import pickle

    assert str(pickle.loads(pickle.dumps(plan))) == text


def test_plan_helpers_mix_bagpipe_and_stock_tables():
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=n, embedding_dim=8, num_embeddings=100, feature_names=[f"f_{n}"])
        for n in "abc"], device=META)
    sharder = BagPipeEmbeddingBagCollectionSharder(fused_params=LR)
    module_plan = construct_module_sharding_plan(
        ebc, {"a": bagpipe(), "b": table_wise(rank=1), "c": data_parallel()}, sharder=sharder,
        local_size=2, world_size=2, device_type="cpu")
    a, b, c = (module_plan[n] for n in "abc")
    assert isinstance(a, BagPipeParameterSharding)
    assert (a.sharding_type, a.compute_kernel, a.ranks) == ("data_parallel", BAGPIPE_KERNEL,
                                                            [0, 1])
    assert (b.sharding_type, b.ranks) == ("table_wise", [1])
    assert (c.sharding_type, c.compute_kernel) == ("data_parallel", "dense")
    # Given to TorchRec's own sharder (DMP without the BagPipe sharders): an error naming
    # the sharders to pass, before anything is built.
    with pytest.raises(ValueError, match="bagpipe_sharders"):
        EmbeddingBagCollectionSharder(fused_params=LR).shard(
            ebc, dict(module_plan), ShardingEnv.from_local(2, 0), torch.device("cpu"))


def test_the_package_replaces_nothing_of_torchrecs():
    # In a fresh interpreter: every attribute of every torchrec module, and of every class
    # in them, is the same object before and after importing the whole package; the one
    # change is the registered perf config (TorchRec's registry, its extension point).
    script = textwrap.dedent("""
        import importlib, inspect, sys
        import torchrec, torchrec.distributed.planner, torchrec.distributed.model_parallel
        import torchrec.distributed.train_pipeline, torchrec.distributed.planner.estimator
        from torchrec.distributed.planner.estimator import EmbeddingPerfEstimatorFactory

        def snapshot():
            out = {}
            for name, mod in list(sys.modules.items()):
                if not name.startswith(("torchrec", "fbgemm_gpu")) or mod is None:
                    continue
                for attr, value in list(vars(mod).items()):
                    out[(name, attr)] = id(value)
                    if inspect.isclass(value) and value.__module__ == name:
                        for k, v in list(vars(value).items()):
                            out[(name, attr, k)] = id(v)
            return out

        before = snapshot()
        registry = dict(EmbeddingPerfEstimatorFactory._registry)
        for m in ("torchrec_bagpipe", "torchrec_bagpipe.distributed.sharder",
                  "torchrec_bagpipe.distributed.sharding_planner",
                  "torchrec_bagpipe.distributed.plan_helpers",
                  "torchrec_bagpipe.distributed.train_pipeline",
                  "torchrec_bagpipe.distributed.job"):
            importlib.import_module(m)
        after = snapshot()
        changed = sorted(str(k) for k in before if k in after and before[k] != after[k])
        added = sorted(str(k) for k in after if k not in before and len(k) == 2
                       and k[0] in {n for n, *_ in before}
                       and not inspect.ismodule(getattr(sys.modules[k[0]], k[1], None)))
        assert not changed and not added, (changed, added)
        new = {k: v for k, v in EmbeddingPerfEstimatorFactory._registry.items()
               if registry.get(k) is not v}
        assert [(k, v.__name__) for k, v in new.items()] == [
            ("default_estimator", "BagPipeAwarePerfConfig")], new
        print("ok", len(before))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_an_all_bagpipe_plan_is_written_without_torchrecs_warnings(caplog):
    from torchrec.distributed.planner.types import PlannerError

    model = _model()
    del model.ebc.embedding_bags["fp16"]  # every table then goes to BagPipe
    model.ebc._embedding_bag_configs = [c for c in model.ebc.embedding_bag_configs()
                                        if c.name != "fp16"]
    sharders = bagpipe_sharders(fused_params=LR)
    with caplog.at_level("WARNING"):
        plan = BagPipeShardingPlanner(topology=_topology(), batch_size=32).plan(model, sharders)
    assert _on_bagpipe(plan) == set(_kernels(plan)) and len(_kernels(plan)) == 8
    assert list(plan.plan["ebc"]) == list(ROWS) and "BagPipe first" in str(plan)
    assert not [r for r in caplog.records if "Sharding spec not found" in r.getMessage()]
    # The caches must still fit in the ranks' memory.
    with pytest.raises(PlannerError, match="caches"):
        BagPipeShardingPlanner(topology=Topology(world_size=2, compute_device="cpu",
                                                 ddr_cap=10_000), batch_size=32
                               ).plan(model, sharders)


@settings(max_examples=200, deadline=None)
@given(lookups=st.integers(0, 10**6), rows=st.integers(1, 10**7), dim=st.integers(1, 512),
       cache=st.integers(0, 10**7))
def test_step_traffic_is_bounded_by_the_lookups_the_rows_and_the_cache(lookups, rows, dim,
                                                                        cache):
    from torchrec_bagpipe.distributed.estimators import bagpipe_perf
    from torchrec_bagpipe.distributed.perf_model import DEFAULT_PS_LINK, step_traffic

    t = step_traffic(lookups, rows, dim, cache)
    assert 0 <= t.fetched_rows <= t.unique <= min(lookups, rows)
    assert t.commit_bytes == t.unique * (dim * 4 + 8)
    if cache >= rows:
        assert t.fetched_rows == 0 and t.fetch_bytes == 0
    # More cache never fetches more; the link's time grows with the bytes.
    more = step_traffic(lookups, rows, dim, cache + rows // 2 + 1)
    assert more.fetched_rows <= t.fetched_rows
    perf = bagpipe_perf(lookups, rows, dim, cache, device_bw=1e7, bwd_compute_multiplier=2)
    assert perf.bwd_comms == pytest.approx(DEFAULT_PS_LINK.commit_ms(t.commit_bytes))
    assert perf.fwd_comms >= 1e3 * t.fetch_bytes / DEFAULT_PS_LINK.bytes_per_s - 1e-12
    assert perf.bwd_compute == pytest.approx(2 * perf.fwd_compute)


def test_capability_table():
    from torchrec_bagpipe.distributed.capability import stock_cannot_train

    fp32 = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=4, feature_names=["f"])
    bf16 = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=4, feature_names=["f"],
                           data_type=DataType.BF16)
    for opt in ("EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD", None):
        assert stock_cannot_train(fp32, opt, "cpu") is None
        assert stock_cannot_train(fp32, opt, "cuda") is None
    assert "adam" in stock_cannot_train(fp32, "ADAM", "cpu")
    assert stock_cannot_train(fp32, "ADAM", "cuda") is None
    assert "bf16" in stock_cannot_train(bf16, None, "cpu").lower()
    assert stock_cannot_train(bf16, None, "cuda") is None
