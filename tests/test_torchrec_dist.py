"""Multi-process proof of the TorchRec integration (gloo, world size 2, small models).

Each test spawns one process group and runs many configurations inside it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from typing import Any

import _scenarios as S
import pytest
import torch
from _dist import run_world

pytestmark = pytest.mark.slow

WORLD = 2


def _setup(rank: int, world: int) -> None:
    """Per-rank set-up: the tests run the real runtime and PS (nothing to replace)."""
    torch.manual_seed(rank)


def _env(tmp: str) -> dict[str, str]:
    return {"BAGPIPE_TEST_TMP": tmp}


CONFIGS = [
    {"bagpipe_aggregation": agg, "optimization_prescan": prescan,
     "optimization_cache_capacity": cap}
    for agg, prescan, cap in itertools.product(["ps", "collective"], [True, False], [1, 64])
]


# ---- equivalence -------------------------------------------------------------------------------
def _equivalence(rank: int, world: int, kinds: list[str]) -> list[str]:
    _setup(rank, world)
    problems: list[str] = []
    for kind in kinds:
        for i, config in enumerate(CONFIGS):
            losses = {}
            for loop in ("plain", "pipeline"):
                case = S.Case(kind=kind, config=dict(config), loop=loop, steps=20, seed=i,
                              planner="hand" if i % 2 else "planner")
                state, losses[loop] = S.train_dmp(case, rank, world)
                if rank == 0:
                    want = S.train_reference(case, world)
                    problems.extend(S.compare(state, want, case.label()))
            if losses["plain"] != pytest.approx(losses["pipeline"], rel=1e-6, abs=1e-7):
                problems.append(f"{kind} {config}: pipeline losses differ from the plain loop")
    # A model whose second EBC keeps TorchRec's stock kernel (planner constraint).
    for i in (0, 5):
        for loop in ("plain", "pipeline"):
            case = S.Case(kind="mixed", config=dict(CONFIGS[i]), loop=loop, seed=i)
            state, _ = S.train_dmp(case, rank, world)
            if rank == 0:
                problems.extend(S.compare(state, S.train_reference(case, world), case.label()))
    # TorchRec's gradient division off: the PS sums the ranks' gradients.
    for loop in ("plain", "pipeline"):
        case = S.Case(kind="weighted", config={"gradient_division": False}, loop=loop, seed=31)
        state, _ = S.train_dmp(case, rank, world)
        if rank == 0:
            problems.extend(S.compare(state, S.train_reference(case, world), case.label()))
    problems.extend(_meta_lazy_init(rank, world))
    problems.extend(_optimizers(rank, world))
    problems.extend(_writeback_bitwise(rank, world))
    return problems


# The optimizers under an LR schedule (issue 11): a representative subset of the runtime's
# full matrix (tests/test_runtime_controller.py), through DMP: weights and optimizer state
# (the fused optimizer's state_dict, TorchRec's layout) against the single-process model.
OPTIMIZER_CASES = [
    ("adagrad", {"bagpipe_aggregation": "ps", "optimization_cache_capacity": 1}, "plain"),
    ("adagrad", {"bagpipe_aggregation": "collective", "optimization_prescan": True}, "pipeline"),
    ("rowwise_adagrad", {"bagpipe_aggregation": "ps", "optimization_prescan": True,
                         "lookahead": 2, "lookahead_max": 8}, "pipeline"),
    ("rowwise_adagrad", {"bagpipe_aggregation": "collective",
                         "optimization_cache_capacity": 1}, "plain"),
    ("adam", {"bagpipe_aggregation": "ps", "optimization_cache_capacity": 1,
              "lookahead": 2, "lookahead_max": 8}, "pipeline"),  # the adaptive window
    ("adam", {"bagpipe_aggregation": "collective", "optimization_prescan": True}, "plain"),
    ("sgd", {"bagpipe_aggregation": "ps", "optimization_cache_capacity": 1}, "pipeline"),
    ("sgd", {"bagpipe_aggregation": "collective", "optimization_prescan": True}, "plain"),
    ("mixed", {"bagpipe_aggregation": "ps", "optimization_cache_capacity": 1}, "pipeline"),
    # write-back: the caches own their rows (evictions at one unit, none in a large cache)
    ("adam", {"bagpipe_aggregation": "writeback", "optimization_cache_capacity": 1},
     "pipeline"),
    ("rowwise_adagrad", {"bagpipe_aggregation": "writeback", "optimization_prescan": True},
     "plain"),
    ("sgd", {"bagpipe_aggregation": "writeback", "optimization_cache_capacity": 1,
             "lookahead": 2, "lookahead_max": 6}, "pipeline"),
    ("adagrad", {"bagpipe_aggregation": "writeback"}, "pipeline"),  # online, a large cache
]


def _optimizers(rank: int, world: int) -> list[str]:
    problems: list[str] = []
    for i, (name, config, loop) in enumerate(OPTIMIZER_CASES):
        case = S.Case(kind="dlrm", config=dict(config), loop=loop, steps=20, seed=40 + i,
                      optimizer=name, schedule=True)
        state, _ = S.train_dmp(case, rank, world)
        if rank == 0:
            want = S.train_reference(case, world)
            problems.extend(S.compare(state, want, case.label(), rtol=1e-4, atol=1e-5))
            if name != "sgd" and not any(k.startswith("opt:") for k in state):
                problems.append(f"{case.label()}: the fused optimizer has no state")
    return problems


def _writeback_bitwise(rank: int, world: int) -> list[str]:
    """Write-back aggregation trains the same bits as PS-owned rows: at two ranks the
    all-reduced gradient is the PS's rank-ordered sum, and the caches run the PS's arithmetic
    (weights and optimizer state after 20 steps with evictions, exactly equal)."""
    problems: list[str] = []
    for name in ("adam", "adagrad"):
        states = []
        for agg in ("ps", "writeback"):
            case = S.Case(kind="dlrm", config={"bagpipe_aggregation": agg,
                                               "optimization_cache_capacity": 1},
                          loop="pipeline", steps=20, seed=61, optimizer=name, schedule=True)
            states.append(S.train_dmp(case, rank, world)[0])
        if rank == 0:
            problems.extend(S.compare(states[1], states[0], f"writeback == ps ({name})",
                                      rtol=0.0, atol=0.0))
    return problems


def _meta_lazy_init(rank: int, world: int) -> list[str]:
    """Tables built on `meta` are initialised lazily and deterministically on the PS."""
    from torchrec_bagpipe.distributed import close_model

    problems = []
    case = S.Case(kind="weighted", meta=True, seed=11, planner="hand")
    starts = []
    for _ in range(2):
        dmp, _opt = S.make_dmp(case, S.build_model(case.kind, case.seed, meta=True), world)
        starts.append(S.full_state(dmp, rank))
        close_model(dmp)
    if rank == 0:
        problems += S.compare(starts[0], starts[1], "meta init is deterministic", rtol=0, atol=0)
        tables, _ = S.tables_for(case.kind)
        for t in tables:
            w = starts[0][f"ebc.embedding_bags.{t.name}.weight"]
            bound = (1.0 / t.num_embeddings) ** 0.5
            if not (w.abs().max() <= bound and w.abs().max() > 0.5 * bound):
                problems.append(f"meta init of {t.name}: values outside (-{bound}, {bound})")
            if w.unique().numel() < w.numel() // 2:
                problems.append(f"meta init of {t.name}: rows are not distinct")
    # Training from the lazily initialised tables matches the reference from the same start.
    state, _ = S.train_dmp(case, rank, world)
    if rank == 0:
        want = S.train_reference(case, world, init=starts[0])
        problems += S.compare(state, want, "meta-built model")
    return problems


def test_equivalence_with_single_process_training():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_equivalence, WORLD, args=(["dlrm", "weighted", "mean"],),
                            env=_env(tmp), timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


# ---- swap: a stock TorchRec script -------------------------------------------------------------
def _stock_script(rank: int, world: int, use_bagpipe: bool, batches: list[Any]) -> dict:
    """TorchRec's DLRM recipe: planner + DMP + CombinedOptimizer + TrainPipelineSparseDist.
    The only difference between the two runs is which planner and sharders are passed."""
    import torch.distributed as dist
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import (
        BagPipeEmbeddingBagCollectionSharder,
        BagPipeShardingPlanner,
    )

    planner_cls = BagPipeShardingPlanner if use_bagpipe else EmbeddingShardingPlanner
    # (placement_min_rows=0: these small tables go to BagPipe, not by size to stock kernels)
    sharders = ([BagPipeEmbeddingBagCollectionSharder(BagPipeConfig(placement_min_rows=0))]
                if use_bagpipe else get_default_sharders())
    # -------- the stock script from here on --------
    model = S.build_model("dlrm", seed=3)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    apply_optimizer_in_backward(torch.optim.SGD, model.model.sparse_arch.parameters(),
                                {"lr": S.EMB_LR})
    planner = planner_cls(topology=Topology(world_size=world, compute_device="cpu"),
                          batch_size=8)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan,
                                   sharders=sharders)
    dmp.load_state_dict(initial)  # TorchRec's sharded kernels do not keep module weights
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=S.DENSE_LR))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    it = iter(batches)
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
    # -------- end of the stock script --------
    from torchrec_bagpipe.distributed import bagpipe_modules

    assert bool(bagpipe_modules(dmp)) == use_bagpipe
    return S.full_state(dmp, rank)


def _swap_and_state_dict(rank: int, world: int) -> list[str]:
    _setup(rank, world)
    from torchrec_bagpipe.distributed import close_model

    problems: list[str] = []
    case = S.Case(kind="dlrm", steps=12, seed=3)
    samples = S.make_samples("dlrm", case.steps, world, case.batch, case.seed)
    batches = S.batches_for("dlrm", samples, rank, case.seed, shuffle_keys=False)
    stock = _stock_script(rank, world, False, batches)
    ours = _stock_script(rank, world, True, batches)
    if rank == 0:
        want = S.train_reference(case, world)
        problems += S.compare(stock, want, "stock TorchRec vs reference")
        problems += S.compare(ours, want, "BagPipe swap vs reference")
        problems += S.compare(ours, stock, "BagPipe swap vs stock TorchRec")

    # state_dict round trip through the PS: save, load into a model built differently, and
    # both continue identically.
    more = S.batches_for("dlrm", S.make_samples("dlrm", 6, world, 8, 99), rank, 99)
    case_a = S.Case(kind="dlrm", steps=6, seed=3)
    model_a = S.build_model("dlrm", 3)
    dmp_a, opt_a = S.make_dmp(case_a, model_a, world)
    for b in batches[:6]:
        opt_a.zero_grad()
        loss, _ = dmp_a(b)
        loss.backward()
        opt_a.step()
    saved = {k: v.clone() for k, v in dmp_a.state_dict().items()}
    model_b = S.build_model("dlrm", 77)  # different initial weights
    dmp_b, opt_b = S.make_dmp(case_a, model_b, world)
    dmp_b.load_state_dict(dict(saved))  # DMP rewrites the keys of the dict it gets
    problems += S.compare(dict(dmp_b.state_dict()), saved, "load_state_dict round trip",
                          rtol=0, atol=0)
    for dmp, opt in ((dmp_a, opt_a), (dmp_b, opt_b)):
        for b in more:
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
    problems += S.compare(dict(dmp_b.state_dict()), dict(dmp_a.state_dict()),
                          "training after load_state_dict", rtol=0, atol=0)
    close_model(dmp_a)
    close_model(dmp_b)
    problems += _optimizer_state_round_trip(rank, world, batches, more)
    return problems


def _optimizer_state_round_trip(rank: int, world: int, batches: list[Any],
                                more: list[Any]) -> list[str]:
    """The fused optimizer's state_dict (Adam: moments and step count; row-wise Adagrad)
    saved from one model and loaded into another: both continue identically."""
    from torchrec_bagpipe.distributed import close_model

    problems: list[str] = []
    for name in ("adam", "rowwise_adagrad"):
        case = S.Case(kind="dlrm", steps=6, seed=3, optimizer=name,
                      config={"optimization_cache_capacity": 1})
        dmp_a, opt_a = S.make_dmp(case, S.build_model("dlrm", 3), world)
        for b in batches[:6]:
            opt_a.zero_grad()
            loss, _ = dmp_a(b)
            loss.backward()
            opt_a.step()
        saved_model = {k: v.clone() for k, v in dmp_a.state_dict().items()}
        saved_opt = opt_a.state_dict()
        fused = S.fused_state(opt_a)
        if not fused or (name == "adam" and fused["opt:t0.step"].item() != 6):
            problems.append(f"{name}: fused optimizer state {sorted(fused)}")
        dmp_b, opt_b = S.make_dmp(case, S.build_model("dlrm", 77), world)
        dmp_b.load_state_dict(dict(saved_model))
        opt_b.load_state_dict(saved_opt)
        problems += S.compare(S.fused_state(opt_b), fused, f"{name}: optimizer state loaded",
                              rtol=0, atol=0)
        for dmp, opt in ((dmp_a, opt_a), (dmp_b, opt_b)):
            for b in more:
                opt.zero_grad()
                loss, _ = dmp(b)
                loss.backward()
                opt.step()
        problems += S.compare({**dict(dmp_b.state_dict()), **S.fused_state(opt_b)},
                              {**dict(dmp_a.state_dict()), **S.fused_state(opt_a)},
                              f"{name}: training after loading the optimizer state",
                              rtol=0, atol=0)
        close_model(dmp_a)
        close_model(dmp_b)
    return problems


def test_stock_torchrec_script_swaps_in_bagpipe_and_state_dict_round_trips():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_swap_and_state_dict, WORLD, env=_env(tmp), timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


# ---- errors ------------------------------------------------------------------------------
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


def _errors(rank: int, world: int) -> list[str]:
    _setup(rank, world)
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_bagpipe.distributed import (
        BagPipeEmbeddingBagCollectionSharder,
        BagPipeTrainPipeline,
        UnsupportedOptimizerError,
        bagpipe_plan,
        close_model,
    )

    problems: list[str | None] = []
    samples = S.make_samples("dlrm", 4, world, 8, 5)
    batches = S.batches_for("dlrm", samples, rank, 5)

    # Out-of-range ids: ValueError naming the feature, the table and the value.
    # This world reaches its hosted PS shards over loopback TCP, its own shard included.
    case = S.Case(kind="dlrm", steps=4, seed=5, config={"ps_type": "tcp"})
    dmp, opt = S.make_dmp(case, S.build_model("dlrm", 5), world)
    bad = S.batches_for("dlrm", samples, rank, 5)[0]
    kjt = bad.sparse_features
    values = kjt.values().clone()
    f1 = kjt.keys().index("f1")
    start = int(sum(kjt.length_per_key()[:f1]))
    if kjt.length_per_key()[f1] == 0:
        raise AssertionError("test data: f1 has no ids in the first batch")
    values[start] = 30  # table t1 has 30 rows
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    bad.sparse_features = KeyedJaggedTensor(keys=kjt.keys(), values=values,
                                            lengths=kjt.lengths())
    problems.append(_expect(lambda: dmp(bad), ValueError, "'f1'", "'t1'", "30", "[0, 30)"))
    # The model is still usable after the refused batch.
    loss, _ = dmp(batches[0])
    loss.backward()
    opt.step()

    # A learning rate the PS cannot apply: a clear error at the step, before any commit.
    fused = [g for g in opt.param_groups if "fused_table" in g]
    for group in fused:
        group["lr"] = float("nan")

    def step_with_bad_lr() -> None:
        opt.zero_grad()
        loss, _ = dmp(batches[1])
        loss.backward()
        opt.step()

    problems.append(_expect(step_with_bad_lr, ValueError, "finite and >= 0"))
    for group in fused:  # the step that failed finishes (zero gradient) when closing
        group["lr"] = 0.1
    close_model(dmp)

    # An unsupported in-backward optimizer is refused when sharding, naming what is supported.
    for cls, kwargs, needle in ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum"),
                                (torch.optim.RMSprop, {"lr": 0.1}, "RMSprop")):
        model = S.build_model("dlrm", 5)
        apply_optimizer_in_backward(cls, model.model.sparse_arch.parameters(), kwargs)
        problems.append(_expect(
            lambda model=model: DistributedModelParallel(
                model, device=torch.device("cpu"), plan=bagpipe_plan(model, world),
                sharders=[BagPipeEmbeddingBagCollectionSharder()]),
            UnsupportedOptimizerError, needle, "RowWiseAdagrad",
        ))

    # A DMP built without the BagPipe sharder for a BagPipe plan fails loudly.
    model = S.build_model("dlrm", 5)
    problems.append(_expect(
        lambda: DistributedModelParallel(model, device=torch.device("cpu"),
                                         plan=bagpipe_plan(model, world)),
        ValueError, "BagPipeEmbeddingBagCollectionSharder",
    ))

    # Prescan mismatch: the pipeline is fed other batches than the prescanned ones.
    case = S.Case(kind="dlrm", steps=4, seed=5,
                  config={"optimization_prescan": True, "ps_type": "tcp"})
    dmp, opt = S.make_dmp(case, S.build_model("dlrm", 5), world)
    pipe = BagPipeTrainPipeline(dmp, opt, torch.device("cpu"), prescan_batches=batches)
    swapped = [batches[0], batches[2], batches[1], batches[3]]

    def run_mismatched() -> None:
        it = iter(swapped)
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break

    problems.append(_expect(run_mismatched, ValueError, "step 1"))
    close_model(dmp)

    # Every module of a process shares one PS deployment.
    case = S.Case(kind="dlrm", steps=4, seed=5, config={"ps_type": "local"})
    problems.append(_expect(lambda: S.make_dmp(case, S.build_model("dlrm", 5), world),
                            ValueError, "ps_type"))
    return [p for p in problems if p]


def test_clear_errors():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_errors, WORLD, env=_env(tmp), timeout=300)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps]
    assert not problems, "\n".join(problems)


# ---- TCP transport with PS server processes, and a dead PS -------------------------------------
def _tcp_world(rank: int, world: int, server_pid: int) -> list[str]:
    import signal as _signal

    from torchrec_bagpipe.distributed import close_model

    _setup(rank, world)
    problems: list[str] = []
    tcp = {"ps_type": "tcp", "ps_timeout": 20.0}
    cases = [
        S.Case(kind="dlrm", loop="plain", config=dict(tcp), seed=21),
        S.Case(kind="dlrm", loop="pipeline", config={**tcp, "optimization_cache_capacity": 1},
               seed=22),
        S.Case(kind="weighted", loop="pipeline",
               config={**tcp, "optimization_prescan": True, "bagpipe_aggregation": "collective"},
               seed=23),
        S.Case(kind="mean", loop="plain",
               config={**tcp, "optimization_prescan": True, "optimization_cache_capacity": 1},
               seed=24),
    ]
    for case in cases:
        state, _ = S.train_dmp(case, rank, world)
        if rank == 0:
            problems += S.compare(state, S.train_reference(case, world), "tcp " + case.label())

    # A PS server dies mid-training: every rank gets a clear error, nothing hangs.
    case = S.Case(kind="dlrm", steps=30, config=dict(tcp), seed=25)
    dmp, opt = S.make_dmp(case, S.build_model("dlrm", 25), world)
    batches = S.batches_for("dlrm", S.make_samples("dlrm", 30, world, 8, 25), rank, 25)
    error: BaseException | None = None
    try:
        for i, b in enumerate(batches):
            if i == 5:
                torch.distributed.barrier()
                if rank == 0:
                    os.kill(server_pid, _signal.SIGKILL)
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
        dmp.module.model.sparse_arch.embedding_bag_collection.flush()
    except BaseException as e:  # the failure under test
        error = e
    names = {"TransportError", "ControllerError", "SessionError", "TimeoutError"}
    if error is None:
        problems.append(f"rank {rank}: training went on although a PS server died")
    elif type(error).__name__ not in names:
        problems.append(f"rank {rank}: unexpected {type(error).__name__}: {error}")
    try:
        close_model(dmp)
    except Exception as e:
        if type(e).__name__ not in names:
            problems.append(f"rank {rank}: close after the failure raised {e!r}")
    return problems


def test_tcp_transport_with_two_ps_server_processes_and_a_dead_ps():
    import secrets

    from torchrec_bagpipe.ps.shard import spawn_server

    token = secrets.token_hex(8)
    servers = [spawn_server(s, 2, job_token=token, args=["--quiet"]) for s in range(2)]
    try:
        env = {"BAGPIPE_PS_ADDRESSES": ",".join(s.address for s in servers),
               "BAGPIPE_JOB_TOKEN": token}
        results = run_world(_tcp_world, WORLD, args=(servers[1].pid,), env=env, timeout=300)
    finally:
        for s in servers:
            with contextlib.suppress(Exception):
                s.kill()
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
