"""Multi-process proof of per-table placement (gloo, world size 2): one EmbeddingBagCollection
mixing BagPipe, data-parallel, table-wise and row-wise tables, and EmbeddingCollections
(BagPipe only, and mixed), against the single-process model on the global batch, with the
plain loop, `BagPipeTrainPipeline` and TorchRec's `TrainPipelineSparseDist`, in both
aggregation modes, online and prescan, with one-unit and large caches, with SGD and with the
other optimizers under a learning-rate schedule (BagPipe and stock fused tables in one fused
optimizer); the mixed module's state dict and fused optimizer (its optimizer state in
TorchRec's layout, saved and loaded); and the clear errors of bad placements and inputs.

Each test spawns one process group and runs many configurations inside it.
"""

from __future__ import annotations

import tempfile
from typing import Any

import _scenarios as S
import pytest
import torch
from _dist import run_world

pytestmark = pytest.mark.slow

WORLD = 2

CONFIGS = [
    {"bagpipe_aggregation": "ps", "optimization_cache_capacity": 1},
    {"bagpipe_aggregation": "collective", "optimization_prescan": True},
    {"bagpipe_aggregation": "ps", "optimization_prescan": True,
     "optimization_cache_capacity": 64},
    {"bagpipe_aggregation": "collective", "optimization_cache_capacity": 1},
]


def _equivalence(rank: int, world: int, kinds: list[str]) -> list[str]:
    torch.manual_seed(rank)
    problems: list[str] = []
    for kind in kinds:
        for i, config in enumerate(CONFIGS):
            losses = {}
            for loop in ("plain", "pipeline", "torchrec"):
                # Hand plans (row-wise stock tables) and the planner (constraints) in turn.
                case = S.Case(kind=kind, config=dict(config), loop=loop, steps=12, seed=40 + i,
                              planner="hand" if i % 2 == 0 else "planner")
                state, losses[loop] = S.train_dmp(case, rank, world)
                if rank == 0:
                    problems.extend(S.compare(state, S.train_reference(case, world),
                                              case.label()))
            for loop in ("pipeline", "torchrec"):
                if losses["plain"] != pytest.approx(losses[loop], rel=1e-6, abs=1e-7):
                    problems.append(f"{kind} {config}: {loop} losses differ from the plain loop")
        problems.extend(_optimizers(rank, world, kind))
    return problems


# Other optimizers under an LR schedule (issue 11 on issue 13's modules): weights and
# optimizer state (the combined fused optimizer's state_dict: BagPipe's and the stock fused
# tables') against the single-process model. Per kind: (optimizer, config, loop, planner).
# "adam_stock_adagrad": the BagPipe tables Adam in backward, the stock tables Adagrad.
OPTIMIZER_CASES: dict[str, list[tuple[str, dict[str, Any], str, str]]] = {
    "mixed_ebc": [("adagrad", CONFIGS[0], "plain", "hand"),
                  ("rowwise_adagrad", CONFIGS[1], "pipeline", "planner")],
    "mixed_weighted": [("adam_stock_adagrad", CONFIGS[2], "torchrec", "hand")],
    "ec": [("rowwise_adagrad", CONFIGS[3], "torchrec", "planner")],
    "ec_mixed": [("adagrad", CONFIGS[0], "pipeline", "hand"),
                 ("adam_stock_adagrad", CONFIGS[1], "plain", "planner")],
}


def _optimizers(rank: int, world: int, kind: str) -> list[str]:
    problems: list[str] = []
    for i, (name, config, loop, planner) in enumerate(OPTIMIZER_CASES[kind]):
        case = S.Case(kind=kind, config=dict(config), loop=loop, steps=12, seed=60 + i,
                      planner=planner, optimizer=name, schedule=True)
        state, _ = S.train_dmp(case, rank, world)
        if rank == 0:
            problems.extend(S.compare(state, S.train_reference(case, world), case.label(),
                                      rtol=1e-4, atol=1e-5))
            if not any(k.startswith("opt:") for k in state):
                problems.append(f"{case.label()}: the fused optimizer has no state")
    return problems


def test_mixed_ebc_trains_like_the_single_process_model():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_equivalence, WORLD, args=(["mixed_ebc", "mixed_weighted"],),
                            env={"BAGPIPE_TEST_TMP": tmp}, timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def test_embedding_collection_trains_like_the_single_process_model():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_equivalence, WORLD, args=(["ec", "ec_mixed"],),
                            env={"BAGPIPE_TEST_TMP": tmp}, timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


# ---- one state dict, one fused optimizer; eval and sequence outputs --------------------------
def _state_and_outputs(rank: int, world: int) -> list[str]:
    from torchrec_bagpipe.distributed import close_model

    torch.manual_seed(rank)
    problems: list[str] = []
    case = S.Case(kind="mixed_ebc", steps=4, seed=7, planner="hand")
    samples = S.make_samples(case.kind, 8, world, case.batch, case.seed)
    batches = S.batches_for(case.kind, samples, rank, case.seed)
    dmp_a, opt_a = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    for b in batches[:4]:
        opt_a.zero_grad()
        loss, _ = dmp_a(b)
        loss.backward()
        opt_a.step()
    # The state dict: the unsharded module's keys, in its order.
    unsharded = list(S.build_model(case.kind, case.seed).ebc.state_dict())
    got = list(dmp_a.module.ebc.state_dict())
    if got != unsharded:
        problems.append(f"state dict keys {got} != {unsharded}")
    if sorted(dmp_a.state_dict()) != sorted(S.build_model(case.kind, 1).state_dict()):
        problems.append(f"DMP state dict keys: {sorted(dmp_a.state_dict())}")
    # One fused optimizer: the BagPipe tables' groups and the stock fused tables'.
    keys = set(dmp_a.fused_optimizer.params)
    want = {"ebc.embedding_bags.a.weight", "ebc.embedding_bags.e.weight",
            "ebc.embedding_bags.d.weight", *(["ebc.embedding_bags.c.weight"] if rank == 1
                                             else [])}
    if keys != want:
        problems.append(f"rank {rank}: fused optimizer params {sorted(keys)} != {sorted(want)}")
    # Save, load into a model built from other weights, both continue identically.
    saved = dict(dmp_a.state_dict())
    dmp_b, opt_b = S.make_dmp(case, S.build_model(case.kind, 77), world)
    dmp_b.load_state_dict(saved)
    before_a, before_b = S.full_state(dmp_a, rank), S.full_state(dmp_b, rank)
    problems += S.compare(before_b, before_a, "mixed load_state_dict round trip", rtol=0,
                          atol=0)
    for dmp, opt in ((dmp_a, opt_a), (dmp_b, opt_b)):
        for b in batches[4:]:
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
    problems += S.compare(S.full_state(dmp_b, rank), S.full_state(dmp_a, rank),
                          "mixed training after load_state_dict", rtol=0, atol=0)
    # Eval forwards read the BagPipe rows from the PS; both parts agree with the unsharded
    # model loaded with the trained weights.
    trained = S.full_state(dmp_a, rank)
    dmp_a.eval()
    with torch.no_grad():
        got = dmp_a.module.ebc(batches[0].sparse_features).wait()
    if rank == 0:
        ref = S.build_model(case.kind, case.seed)
        ref.load_state_dict(trained)
        want_kt = ref.ebc(batches[0].sparse_features)
        if got.keys() != want_kt.keys() or not torch.allclose(got.values(), want_kt.values(),
                                                              atol=1e-6):
            problems.append("mixed eval forward differs from the unsharded module")
    close_model(dmp_a)
    close_model(dmp_b)

    # A mixed EmbeddingCollection with need_indices: one JaggedTensor per feature, the ids as
    # weights, lengths as the input's, values the unsharded module's.
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import bagpipe_plan, bagpipe_sharders

    tables, _ = S.tables_for("ec_mixed")
    torch.manual_seed(5)
    ec = EmbeddingCollection(tables=tables, need_indices=True)  # type: ignore[arg-type]
    initial = {k: v.clone() for k, v in ec.state_dict().items()}
    sharders = bagpipe_sharders(BagPipeConfig(), {"learning_rate": 0.1})
    dmp = DistributedModelParallel(ec, device=torch.device("cpu"),
                                   plan=bagpipe_plan(ec, world, stock=S.STOCK["ec_mixed"]),
                                   sharders=sharders)  # type: ignore[arg-type]
    dmp.load_state_dict(initial)
    kjt = S.batches_for("ec_mixed", S.make_samples("ec_mixed", 1, world, 6, 9), rank, 9)[0]
    kjt = kjt.sparse_features
    got_jt = dmp(kjt).wait()
    reference = EmbeddingCollection(tables=tables, need_indices=True)  # type: ignore[arg-type]
    reference.load_state_dict(initial)
    want_jt = reference(kjt)
    if list(got_jt) != list(want_jt):
        problems.append(f"EC keys {list(got_jt)} != {list(want_jt)}")
    for k in want_jt:
        a, b = got_jt[k], want_jt[k]
        if not (torch.equal(a.lengths(), b.lengths()) and torch.equal(a.weights(), b.weights())
                and torch.allclose(a.values(), b.values(), atol=1e-7)):
            problems.append(f"EC output {k} differs from the unsharded module's")
    close_model(dmp)
    problems += _optimizer_state_round_trip(rank, world)
    return problems


def _optimizer_state_round_trip(rank: int, world: int) -> list[str]:
    """The combined fused optimizer's state_dict of a mixed EBC (BagPipe tables Adam: moments
    and step count from the PS; stock fused tables fbgemm's Adagrad, sharded) saved from one
    model and loaded into another: both continue identically."""
    from torchrec_bagpipe.distributed import close_model

    problems: list[str] = []
    case = S.Case(kind="mixed_ebc", steps=4, seed=8, planner="hand",
                  optimizer="adam_stock_adagrad", config={"optimization_cache_capacity": 1})
    batches = S.batches_for(case.kind, S.make_samples(case.kind, 6, world, 4, 8), rank, 8)
    dmp_a, opt_a = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    for b in batches[:4]:
        opt_a.zero_grad()
        loss, _ = dmp_a(b)
        loss.backward()
        opt_a.step()
    saved_model = dict(dmp_a.state_dict())
    saved_opt = opt_a.state_dict()
    fused = S.fused_state(opt_a)
    want = {"opt:a.momentum1", "opt:a.exp_avg_sq", "opt:a.step", "opt:e.momentum1",
            "opt:e.exp_avg_sq", "opt:e.step", "opt:c.momentum1", "opt:d.momentum1"}
    if set(fused) != want or fused["opt:a.step"].item() != 4:
        problems.append(f"mixed fused optimizer state: {sorted(fused)}")
    dmp_b, opt_b = S.make_dmp(case, S.build_model(case.kind, 77), world)
    dmp_b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    problems += S.compare(S.fused_state(opt_b), fused, "mixed optimizer state loaded",
                          rtol=0, atol=0)
    for dmp, opt in ((dmp_a, opt_a), (dmp_b, opt_b)):
        for b in batches[4:]:
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
    problems += S.compare({**S.full_state(dmp_b, rank), **S.fused_state(opt_b)},
                          {**S.full_state(dmp_a, rank), **S.fused_state(opt_a)},
                          "mixed training after loading the optimizer state", rtol=0, atol=0)
    close_model(dmp_a)
    close_model(dmp_b)
    return problems


def test_mixed_state_dict_optimizer_eval_and_sequence_outputs():
    results = run_world(_state_and_outputs, WORLD, timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


# ---- bad placements and inputs ----------------------------------------------------------------
def _expect(fn: Any, exc: type[BaseException], *needles: str) -> str | None:
    try:
        fn()
    except exc as e:
        text = str(e)
        missing = [n for n in needles if n not in text]
        return f"message {text!r} lacks {missing}" if missing else None
    except Exception as e:  # the wrong kind of error
        return f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    return f"expected {exc.__name__}, nothing was raised"


def _errors(rank: int, world: int) -> list[str | None]:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import (
        BagPipeEmbeddingBagCollectionSharder,
        UnsupportedOptimizerError,
        bagpipe_plan,
        bagpipe_sharders,
        close_model,
    )

    problems: list[str | None] = []
    cpu = torch.device("cpu")
    case = S.Case(kind="mixed_ebc", steps=2, seed=3, planner="hand")
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    ebc = dmp.module.ebc
    batches = S.batches_for(case.kind, S.make_samples(case.kind, 2, world, 4, 3), rank, 3)

    # VBE inputs reach BagPipe tables: refused, naming them.
    keys = ["f0", "f1", "f2", "f3"]
    strides = [2, 3, 2, 3]
    lengths = torch.ones(sum(strides), dtype=torch.int32)
    vbe = KeyedJaggedTensor(keys=keys, values=torch.zeros(sum(strides), dtype=torch.int64),
                            lengths=lengths, stride_per_key_per_rank=[[s] for s in strides],
                            inverse_indices=(keys, torch.zeros(4, 3, dtype=torch.int64)))
    problems.append(_expect(lambda: ebc(vbe), ValueError, "VBE", "['a', 'e']"))
    # A KJT without a stock table's feature: refused before anything is submitted.
    kjt = batches[0].sparse_features
    kept = [k for k in list(kjt.keys()) if k != "f3"]
    without = KeyedJaggedTensor.from_lengths_sync(
        keys=kept, values=torch.cat([kjt[k].values() for k in kept]),
        lengths=torch.cat([kjt[k].lengths() for k in kept]))
    problems.append(_expect(lambda: ebc(without), ValueError, "'f3'", "stock"))
    # ... and the module trains on.
    for b in batches:
        opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        opt.step()
    close_model(dmp)

    # A BagPipe placement BagPipe cannot serve: an FP16 table.
    half = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="h", embedding_dim=4, num_embeddings=10, feature_names=["f"],
                           data_type=DataType.FP16),
        EmbeddingBagConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["g"]),
    ])
    sharders = bagpipe_sharders(BagPipeConfig(), {"learning_rate": 0.1})
    problems.append(_expect(
        lambda: DistributedModelParallel(half, device=cpu, plan=bagpipe_plan(half, world),
                                         sharders=sharders),  # type: ignore[arg-type]
        ValueError, "'h'", "FP16", "FP32"))
    # A plan that omits a table of the module.
    model = S.build_model("mixed_ebc", 3)
    plan = bagpipe_plan(model, world, stock=S.STOCK["mixed_ebc"])
    del plan.plan["ebc"]["d"]
    problems.append(_expect(
        lambda: DistributedModelParallel(model, device=cpu, plan=plan, sharders=sharders),
        ValueError, "'d'", "no entry"))
    # A plan naming BagPipe for a module no BagPipe sharder serves (TorchRec's own EC sharder
    # instead of BagPipe's).
    tables, _ = S.tables_for("ec")
    ec = EmbeddingCollection(tables=tables)  # type: ignore[arg-type]
    problems.append(_expect(
        lambda: DistributedModelParallel(
            ec, device=cpu, plan=ShardingPlan(bagpipe_plan(ec, world).plan),
            sharders=[BagPipeEmbeddingBagCollectionSharder(fused_params={"learning_rate": 1}),
                      EmbeddingCollectionSharder()]),
        ValueError, "table 'a'", "BagPipeEmbeddingCollectionSharder"))
    # An optimizer the PS cannot apply exactly on a BagPipe table of a mixed EC: refused at
    # sharding, naming the table and what is supported.
    tables, _ = S.tables_for("ec_mixed")
    ec = EmbeddingCollection(tables=tables)  # type: ignore[arg-type]
    apply_optimizer_in_backward(torch.optim.SGD, [ec.embeddings["a"].weight],
                                {"lr": 0.1, "momentum": 0.9})
    problems.append(_expect(
        lambda: DistributedModelParallel(
            ec, device=cpu, plan=bagpipe_plan(ec, world, stock=S.STOCK["ec_mixed"]),
            sharders=sharders),  # type: ignore[arg-type]
        UnsupportedOptimizerError, "EmbeddingCollection", "table 'a'", "momentum",
        "supported"))
    return problems


def test_bad_placements_and_inputs_get_clear_errors():
    results = run_world(_errors, WORLD, timeout=300)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps if p]
    assert not problems, "\n".join(problems)
