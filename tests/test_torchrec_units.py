"""Single-process tests of the TorchRec layer: planner, sharder, optimizer checks, datasets,
launcher helpers and metrics (the multi-process behaviour is in test_torchrec_dist.py)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.datasets import (
    PowerLawCriteoDataset,
    power_law_ranks,
    scatter_ids,
    unscatter_ids,
)
from torchrec_bagpipe.distributed import (
    BAGPIPE_KERNEL,
    BagPipeEmbeddingBagCollectionSharder,
    BagPipeShardingPlanner,
    UnsupportedOptimizerError,
    bagpipe_plan,
)
from torchrec_bagpipe.distributed.sharding_planner import BagPipeParameterSharding
from torchrec_bagpipe.distributed.table_optimizer import TableOptimizer, table_optimizer
from torchrec_bagpipe.launch import parse_args, rewrite_ps_type
from torchrec_bagpipe.metrics_table import format_table, summarize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ebc(device: str = "meta", sizes=(1000, 800, 50), dims=(8, 8, 4)) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=n,
                               feature_names=[f"f{i}"])
            for i, (n, d) in enumerate(zip(sizes, dims))
        ],
        device=torch.device(device),
    )


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = _ebc()
        self.small = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="s0", embedding_dim=4, num_embeddings=100,
                                       feature_names=["g0"])],
            device=torch.device("meta"),
        )


# ---- planner ---------------------------------------------------------------------------------
def test_planner_places_every_table_on_bagpipe_and_keeps_constrained_tables_stock():
    planner = BagPipeShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"),
        constraints={"s0": ParameterConstraints(sharding_types=["table_wise"],
                                                compute_kernels=["fused"])},
    )
    # placement_min_rows=0: every table goes to BagPipe unless constrained.
    sharder = BagPipeEmbeddingBagCollectionSharder(BagPipeConfig(placement_min_rows=0),
                                                   fused_params={"learning_rate": 0.1})
    plan = planner.plan(_Two(), [sharder])
    for name in ("t0", "t1", "t2"):
        ps = plan.plan["big"][name]
        assert ps.compute_kernel == BAGPIPE_KERNEL
        assert ps.sharding_type == "data_parallel"
        assert ps.ranks == [0, 1]
        assert isinstance(ps, BagPipeParameterSharding)
    assert plan.plan["small"]["s0"].compute_kernel == "fused"
    assert plan.plan["small"]["s0"].sharding_type == "table_wise"


def test_planner_charges_only_cache_and_metadata():
    config = BagPipeConfig(optimization_cache_capacity=2, placement_min_rows=0)
    topo = Topology(world_size=2, compute_device="cpu")
    planner = BagPipeShardingPlanner(topology=topo, batch_size=16)
    module = _ebc(sizes=(1_000_000, 500_000, 50))
    planner.plan(module, [BagPipeEmbeddingBagCollectionSharder(config, {"learning_rate": 1.0})])
    options = planner.get_selected_options()
    by_name = {so.name: so for so in options}
    big = by_name["t0"].shards[0].storage
    full_table = 1_000_000 * 8 * 4
    # Two cache units (128 rows) shared by the 1.5M-row dim-8 fused table: t0's share is
    # ~85 rows, far below the table itself.
    assert big.ddr < full_table / 100
    assert big.hbm == 0
    # TorchRec's own planner plans the BagPipe kernel too (issue 21; tests/test_planner_swap.py).
    plan = EmbeddingShardingPlanner(topology=topo).plan(
        _ebc(), [BagPipeEmbeddingBagCollectionSharder(config, {"learning_rate": 1.0})])
    assert all(ps.compute_kernel == BAGPIPE_KERNEL for ps in plan.plan[""].values())


def test_bagpipe_plan_by_hand():
    plan = bagpipe_plan(_Two(), world_size=3)
    assert set(plan.plan) == {"big", "small"}
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            assert ps.compute_kernel == BAGPIPE_KERNEL and ps.ranks == [0, 1, 2]
    # The plan of a bare EBC is keyed by the root path, as DMP expects.
    assert set(bagpipe_plan(_ebc(), 2).plan) == {""}
    with pytest.raises(ValueError, match="no EmbeddingBagCollection or EmbeddingCollection"):
        bagpipe_plan(torch.nn.Linear(2, 2), 2)
    # A plan naming the BagPipe kernel refuses TorchRec's stock sharder with a clear error.
    with pytest.raises(ValueError, match="BagPipeEmbeddingBagCollectionSharder"):
        plan.plan["big"]["t0"].get_additional_fused_params()


def test_sharder_is_picklable_and_offers_the_bagpipe_kernel():
    config = BagPipeConfig(optimization_prescan=True, lookahead=3)
    sharder = BagPipeEmbeddingBagCollectionSharder(config, {"learning_rate": 0.5})
    again = pickle.loads(pickle.dumps(sharder))
    assert again.config == config and again.fused_params == {"learning_rate": 0.5}
    assert again.module_type is EmbeddingBagCollection
    assert again.compute_kernels("data_parallel", "cpu")[0] == BAGPIPE_KERNEL
    assert BAGPIPE_KERNEL not in again.compute_kernels("table_wise", "cpu")
    usage = again.storage_usage(torch.empty(10_000, 16, device="meta"), "cuda", BAGPIPE_KERNEL)
    assert set(usage) == {"hbm"} and usage["hbm"] < 10_000 * 16 * 4
    with pytest.raises(TypeError, match="BagPipeConfig"):
        BagPipeEmbeddingBagCollectionSharder(config={"lookahead": 2})  # type: ignore[arg-type]
    import torchrec_bagpipe

    assert torchrec_bagpipe.BagPipeEmbeddingBagCollectionSharder is type(sharder)
    assert torchrec_bagpipe.BagPipeShardingPlanner is BagPipeShardingPlanner


# ---- optimizer checks -----------------------------------------------------------------------
def _param_with(cls, **kwargs) -> torch.nn.Parameter:
    from torch.distributed.optim import _apply_optimizer_in_backward

    p = torch.nn.Parameter(torch.zeros(2, 2))
    _apply_optimizer_in_backward(cls, [p], kwargs)
    return p


def test_optimizer_sources_and_unsupported_optimizers():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.optim import SGD as TrecSGD
    from torchrec.optim import RowWiseAdagrad

    from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

    def of(param, fused=None):
        return table_optimizer(param, fused, "table t0")

    # fused_params, with fbgemm's defaults.
    assert of(None, {"learning_rate": 0.25}) == TableOptimizer(OptimizerSpec(), 0.25)
    exact = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 2.0}
    assert of(None, exact) == TableOptimizer(OptimizerSpec(), 2.0)
    for emb, kind in ((EmbOptimType.EXACT_ADAGRAD, "adagrad"), ("adagrad", "adagrad"),
                      ("exact_row_wise_adagrad", "rowwise_adagrad"),
                      (EmbOptimType.EXACT_ROWWISE_ADAGRAD, "rowwise_adagrad"),
                      (EmbOptimType.ROWWISE_ADAGRAD, "rowwise_adagrad"),
                      (EmbOptimType.ADAM, "adam")):
        assert of(None, {"optimizer": emb, "learning_rate": 0.1}).spec.kind == kind
    adam = of(None, {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1, "eps": 1e-6,
                     "beta1": 0.8, "beta2": 0.95})
    assert adam.spec == OptimizerSpec(kind="adam", eps=1e-6, beta1=0.8, beta2=0.95)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    wd = of(None, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1,
                   "weight_decay": 0.01, "weight_decay_mode": WeightDecayMode.L2})
    assert wd.spec.weight_decay == 0.01
    # apply_optimizer_in_backward wins over fused_params, with the class's own defaults.
    assert of(_param_with(torch.optim.SGD, lr=0.5), {"learning_rate": 0.25}).lr == 0.5
    assert of(_param_with(torch.optim.Adagrad, lr=0.1)) == TableOptimizer(
        OptimizerSpec(kind="adagrad", eps=1e-10), 0.1)
    assert of(_param_with(RowWiseAdagrad, lr=0.1, eps=1e-3, initial_accumulator_value=0.5)) == (
        TableOptimizer(OptimizerSpec(kind="rowwise_adagrad", eps=1e-3,
                                     initial_accumulator_value=0.5), 0.1))
    assert of(_param_with(torch.optim.Adam, lr=0.01, betas=(0.5, 0.9), weight_decay=0.1)) == (
        TableOptimizer(OptimizerSpec(kind="adam", beta1=0.5, beta2=0.9, weight_decay=0.1), 0.01))
    assert of(_param_with(torch.optim.SparseAdam, lr=0.01)).spec.kind == "adam"
    assert of(_param_with(TrecSGD, lr=0.3)).spec.kind == "sgd"
    # In-backward kwargs as TorchRec's stock sharder leaves them after sharding another table
    # that shares them (the EmbOptimType added, lr renamed learning_rate).
    shared = _param_with(RowWiseAdagrad, lr=0.1, eps=1e-3)
    shared._optimizer_kwargs[0].update(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                       learning_rate=shared._optimizer_kwargs[0].pop("lr"))
    assert of(shared) == TableOptimizer(OptimizerSpec(kind="rowwise_adagrad", eps=1e-3), 0.1)
    # Unsupported: a clear error naming what is supported.
    for param, fused, needle in [
        (_param_with(torch.optim.SGD, lr=0.1, momentum=0.9), None, "momentum"),
        (_param_with(torch.optim.Adagrad, lr=0.1, lr_decay=0.1), None, "lr_decay"),
        (_param_with(torch.optim.Adam, lr=0.1, amsgrad=True), None, "amsgrad"),
        (_param_with(torch.optim.AdamW, lr=0.1), None, "AdamW"),
        (_param_with(torch.optim.RMSprop, lr=0.1), None, "RMSprop"),
        (None, {"optimizer": EmbOptimType.LAMB, "learning_rate": 1}, "LAMB"),
        (None, {"optimizer": EmbOptimType.LARS_SGD, "learning_rate": 1}, "LARS_SGD"),
        (None, {"optimizer": EmbOptimType.PARTIAL_ROWWISE_ADAM, "learning_rate": 1},
         "PARTIAL_ROWWISE_ADAM"),
        (None, {"learning_rate": 1.0, "momentum": 0.9}, "momentum"),
        (None, {"learning_rate": 1.0, "weight_decay": 0.1}, "WeightDecayMode.L2"),
        (None, {"learning_rate": 1.0, "weight_decay_mode": WeightDecayMode.DECOUPLE},
         "weight_decay_mode"),
        (None, {"learning_rate": 1.0, "max_gradient": 1.0}, "max_gradient"),
    ]:
        with pytest.raises(UnsupportedOptimizerError, match=needle) as info:
            of(param, fused)
        assert "table t0" in str(info.value)
        if needle not in ("WeightDecayMode.L2", "weight_decay_mode", "max_gradient"):
            assert "supported: " in str(info.value) and "RowWiseAdagrad" in str(info.value)
    with pytest.raises(ValueError, match="no learning rate"):
        of(None, None)
    for bad in (-0.1, 0.0):
        with pytest.raises(ValueError, match="must be > 0"):
            of(None, {"learning_rate": bad})
    with pytest.raises(ValueError, match=r"table t0: optimizer\.beta1"):
        of(None, {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1, "beta1": 1.5})


def test_state_entries_tile_the_state_columns():
    from torchrec_bagpipe.distributed.table_optimizer import state_entries
    from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

    for kind, want in (("adagrad", {"momentum1": (0, 3, False)}),
                       ("rowwise_adagrad", {"momentum1": (0, 1, True)}),
                       ("adam", {"momentum1": (0, 3, False), "exp_avg_sq": (3, 6, False)}),
                       ("sgd", {})):
        spec = OptimizerSpec(kind=kind)
        entries = state_entries(spec, 3)
        assert entries == want, kind
        # The entries cover the row's state columns exactly, in order.
        assert sum(b - a for a, b, _ in entries.values()) == spec.state_dim(3), kind


def test_storage_estimate_counts_the_optimizer_state():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    ebc = _ebc(device="cpu", sizes=(1000,), dims=(8,))
    weight = ebc.embedding_bags["t0"].weight
    usage = {}
    for name, fused in (("sgd", {"learning_rate": 0.1}),
                        ("adam", {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1})):
        sharder = BagPipeEmbeddingBagCollectionSharder(fused_params=fused)
        usage[name] = sum(sharder.storage_usage(weight, "cpu", BAGPIPE_KERNEL).values())
    rows = BagPipeConfig().cache_rows(1000)
    assert usage["adam"] - usage["sgd"] == rows * 16 * 4  # Adam: two moments per column


# ---- datasets ---------------------------------------------------------------------------------
def test_power_law_dataset_is_deterministic_per_rank_and_skewed():
    sizes = [10_000] * 26
    a0 = PowerLawCriteoDataset(sizes, 256, 3, zipf_alpha=1.2, seed=5, rank=0, world_size=2)
    a0_again = PowerLawCriteoDataset(sizes, 256, 3, zipf_alpha=1.2, seed=5, rank=0, world_size=2)
    a1 = PowerLawCriteoDataset(sizes, 256, 3, zipf_alpha=1.2, seed=5, rank=1, world_size=2)
    b0, b0_again, b1 = list(a0), list(a0_again), list(a1)
    assert len(b0) == 3
    for x, y in zip(b0, b0_again):
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
        assert torch.equal(x.dense_features, y.dense_features)
        assert torch.equal(x.labels, y.labels)
    assert not torch.equal(b0[0].sparse_features.values(), b1[0].sparse_features.values())
    kjt = b0[0].sparse_features
    assert kjt.keys()[0] == "cat_0" and len(kjt.keys()) == 26 and kjt.stride() == 256
    assert b0[0].dense_features.shape == (256, 13)
    ids = kjt["cat_0"].values()
    assert ids.min() >= 0 and ids.max() < 10_000
    # Skew: the most frequent id is far above the uniform expectation of 256 / 10000.
    assert int(torch.bincount(ids).max()) > 20
    # Hot ids are scattered, not the smallest ids.
    top = int(torch.bincount(ids).argmax())
    assert top != 0


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 5000), salt=st.integers(0, 2**40))
def test_scatter_ids_is_a_bijection(n: int, salt: int):
    ids = scatter_ids(torch.arange(n), n, salt)
    assert torch.equal(torch.sort(ids).values, torch.arange(n))
    assert torch.equal(unscatter_ids(ids, n, salt), torch.arange(n))


def _auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Rank-based AUROC (Mann-Whitney U); scores are continuous, so ties do not occur."""
    order = torch.argsort(scores)
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_power_law_dataset_labels_follow_one_hidden_model_across_streams():
    sizes = [5_000] * 26
    train = PowerLawCriteoDataset(sizes, 512, 4, seed=3, stream=0, multi_hot_sizes=[2] * 26)
    test = PowerLawCriteoDataset(sizes, 512, 4, seed=3, stream=2, multi_hot_sizes=[2] * 26)
    other = PowerLawCriteoDataset(sizes, 512, 4, seed=4, stream=2, multi_hot_sizes=[2] * 26)
    tb, sb = train.batch(0), test.batch(0)
    # Different samples, one hidden model: the train stream's model scores the test stream
    # exactly as the test stream's own, and a different seed is a different model.
    assert not torch.equal(tb.sparse_features.values(), sb.sparse_features.values())
    assert torch.equal(train.label_logits(sb), test.label_logits(sb))
    assert not torch.equal(other.label_logits(sb), test.label_logits(sb))
    # The labels are a learnable function of the features: the hidden logit ranks held-out
    # clicks far better than chance, through the dense and the sparse features each.
    batches = [test.batch(j) for j in range(4)]
    logits = torch.cat([test.label_logits(b) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    assert 0.05 < float(labels.mean()) < 0.95
    assert _auroc(logits, labels) > 0.8
    dense = torch.cat([(b.dense_features.double() - 0.5) @ test._dense_w for b in batches])
    assert _auroc(dense, labels) > 0.55
    assert _auroc(logits - dense, labels) > 0.7
    with pytest.raises(ValueError, match="stream"):
        PowerLawCriteoDataset(sizes, 8, 1, stream=-1)
    with pytest.raises(ValueError, match="keys"):
        other.label_logits(PowerLawCriteoDataset([5_000] * 3, 8, 1).batch(0))


@settings(deadline=None, max_examples=30)
@given(n=st.integers(1, 10**7), alpha=st.floats(0.0, 3.0))
def test_power_law_ranks_stay_in_range_and_decrease(n: int, alpha: float):
    u = torch.linspace(0, 1 - 1e-12, 2001, dtype=torch.float64)
    r = power_law_ranks(u, n, alpha)
    assert int(r.min()) >= 0 and int(r.max()) < n
    assert bool((r[1:] >= r[:-1]).all())  # monotone inverse CDF


def test_power_law_frequencies_follow_the_exponent():
    r = power_law_ranks(torch.rand(400_000, generator=torch.Generator().manual_seed(0)),
                        1000, 1.0)
    counts = torch.bincount(r, minlength=1000).double()
    # P(k) ∝ 1/(k+1): rank 0 about twice rank 1, about 10x rank 9 (continuous approx.).
    assert 1.5 < counts[0] / counts[1] < 2.6
    assert 6.0 < counts[0] / counts[9] < 14.0


# ---- launcher and example CLI ----------------------------------------------------------------
def test_launcher_uses_the_local_backend_on_one_node():
    cmd, kind = rewrite_ps_type(["train.py", "--ps-type", "rdma", "--x", "1"], True, None)
    assert cmd == ["train.py", "--ps-type", "local", "--x", "1"] and kind == "local"
    cmd, kind = rewrite_ps_type(["train.py", "--ps-type=RDMA"], True, None)
    assert cmd == ["train.py", "--ps-type=local"] and kind == "local"
    cmd, kind = rewrite_ps_type(["train.py", "--ps-type", "rdma"], False, None)
    assert cmd[-1] == "rdma" and kind == "rdma"
    assert rewrite_ps_type(["train.py"], False, "tcp")[1] == "tcp"
    args = parse_args(["--nproc-per-node", "2", "--ps-servers", "1", "t.py", "--lr", "3"])
    assert args.command == ["t.py", "--lr", "3"] and args.nproc_per_node == 2
    with pytest.raises(SystemExit):
        parse_args(["--nproc-per-node", "2"])


def test_metrics_summary_and_table():
    per_rank = [
        {"ebc/t": {"accesses": 100, "hits": 60, "prefetch_served": 20, "demand_fetched": 20,
                   "prefetched": 25, "commit_wait_s": 0.5}},
        {"ebc/t": {"accesses": 50, "hits": 30, "prefetch_served": 10, "demand_fetched": 10,
                   "prefetched": 5, "commit_wait_s": 1.5}},
    ]
    s = summarize(per_rank, steps=10)
    assert s["hit_rate"] == pytest.approx(90 / 150)
    assert s["served_rate"] == pytest.approx(120 / 150)
    assert s["fetched_rows"] == 60 and s["fetched_rows_per_step"] == 6
    assert s["commit_wait_s_per_rank"] == pytest.approx(1.0)
    text = format_table({"steps": 10, "samples_per_s": 123.4}, s)
    assert "60.0 %" in text and "80.0 %" in text and "123.4" in text and "commit wait" in text
    assert "runtime_critical_ms" not in s
    assert summarize([{}, {}], 3) == {}


def test_metrics_summary_runtime_times_per_rank_and_step():
    # Two fused tables on rank 0, one on rank 1: summed over a rank's tables, mean over ranks.
    per_rank = [
        {"a": {"runtime_critical_s": 0.2, "runtime_worker_s": 0.5},
         "b": {"runtime_critical_s": 0.1, "runtime_worker_s": 0.1}},
        {"a": {"runtime_critical_s": 0.1, "runtime_worker_s": 0.2}},
    ]
    s = summarize(per_rank, steps=10)
    assert s["runtime_critical_ms"] == pytest.approx(1000 * 0.4 / 2 / 10)
    assert s["runtime_worker_ms"] == pytest.approx(1000 * 0.8 / 2 / 10)
    text = format_table({"steps": 10, "samples_per_s": 1.0}, s)
    assert "20.00 ms on the training thread" in text and "40.00 ms on workers" in text


def test_launcher_console_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "torchrec_bagpipe.launch", "--help"], capture_output=True,
        text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0 and "--ps-servers" in out.stdout




def test_tables_with_other_optimizers_are_other_fused_tables():
    from torchrec.modules.embedding_modules import get_embedding_names_by_table

    from torchrec_bagpipe.distributed.layout import FusedLayout, table_specs
    from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10,
                                  feature_names=[f"f{i}"]) for i in range(5)]
    rowwise = OptimizerSpec(kind="rowwise_adagrad")
    opts = {"t0": TableOptimizer(rowwise, 0.1), "t1": TableOptimizer(rowwise, 0.1),
            "t2": TableOptimizer(OptimizerSpec(kind="rowwise_adagrad", eps=1e-3), 0.1),
            "t3": TableOptimizer(rowwise, 0.2), "t4": TableOptimizer(OptimizerSpec(), 0.1)}
    layout = FusedLayout(table_specs(configs, opts), get_embedding_names_by_table(configs),
                         session=0, module_fqn="m", weighted=False)
    groups = [([t.name for t in f.tables], f.optimizer, f.lr) for f in layout.fused]
    assert groups == [(["t0", "t1"], rowwise, 0.1), (["t2"], opts["t2"].spec, 0.1),
                      (["t3"], rowwise, 0.2), (["t4"], OptimizerSpec(), 0.1)]
    assert len({f.name for f in layout.fused}) == 4


def test_optimizer_kernels_benchmark_measures_every_implementation(capsys):
    """benchmarks/optimizer_kernels.py, briefly: BagPipe's store, fbgemm's CPU kernel and
    torch's optimizers each apply (row-wise) Adagrad within a few ulps of its definition."""
    import json

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import optimizer_kernels

    assert optimizer_kernels.main(["--rows", "64", "--dim", "8", "--steps", "3"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    worst = {(d["optimizer"], d["impl"]): d["value"] for d in lines
             if d["metric"] == "max_ulp_error"}
    assert set(worst) == {(o, i) for o in ("adagrad", "rowwise_adagrad")
                          for i in ("bagpipe_store", "fbgemm_cpu", "torch")}
    assert all(v < 16 for v in worst.values()), worst
