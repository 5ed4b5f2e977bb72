"""The one-line swap in TorchRec's own example patterns (gloo, world size 2), each trained a
few steps and compared with the single-process model on the global batch (tests/_scenarios):

* `DistributedModelParallel(module, device, sharders=bagpipe_sharders())` with no plan (DMP
  builds TorchRec's own planner): a DLRM-shaped EBC, row-wise Adagrad applied in backward,
  TorchRec's `TrainPipelineSparseDist`;
* an EmbeddingCollection with fused Adam + weight decay, a dense Adam and a `StepLR`, on CPU
  (TorchRec's stock kernels cannot run Adam there: capability placement sends the tables to
  BagPipe although the size rule would keep them stock), DMP planning it too;
* a user-built `EmbeddingShardingPlanner(topology=TopologyFactory..., constraints=...)`
  (`collective_plan`), mixing BagPipe and stock tables in one EBC;
* a hand-written plan from TorchRec's plan helpers with `bagpipe()`.
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
STEPS = 8


def _dense_sgd(dmp: Any) -> Any:
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=S.DENSE_LR))
    return CombinedOptimizer([dmp.fused_optimizer, dense])


def _build(case: S.Case, world: int, how: str) -> tuple[Any, Any, Any]:
    """(DMP, optimizer, plan) of `case`, planned `how`: "dmp" (no plan), "torchrec" (a
    user-built TorchRec planner with constraints) or "helpers" (TorchRec's plan helpers)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
    )
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import (
        BagPipeEmbeddingBagCollectionSharder,
        bagpipe,
        bagpipe_sharders,
    )

    model = S.build_model(case.kind, case.seed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    fused_params, in_backward = S.OPTIMIZERS[case.optimizer]
    if in_backward is not None:
        params = [p for t, p in S.table_params(model).items() if case.in_backward(t)]
        apply_optimizer_in_backward(in_backward[0], params, dict(in_backward[1]))
    # The default config: every table BagPipe can serve goes to BagPipe.
    sharders = bagpipe_sharders(BagPipeConfig(**case.config), fused_params=fused_params)
    plan = None
    if how == "torchrec":
        topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=world, local_world_size=world),
            kernel_config=KernelConfig(compute_device="cpu"))
        planner = EmbeddingShardingPlanner(
            topology=topology, batch_size=case.batch,
            storage_reservation=FixedPercentageStorageReservation(0.15),
            constraints=dict(S.STOCK_CONSTRAINTS[case.kind]))
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    elif how == "helpers":
        generators = {"a": bagpipe(), "e": bagpipe(), **S.STOCK[case.kind]}
        module_plan = construct_module_sharding_plan(
            model.ebc, generators, sharder=BagPipeEmbeddingBagCollectionSharder(
                fused_params=fused_params), local_size=world, world_size=world,
            device_type="cpu")
        plan = ShardingPlan({"ebc": module_plan})
    elif how in ("stock_plan", "stock_plan_torchrec"):
        # A plan by TorchRec's planner without the BagPipe sharders.
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        stock = [EmbeddingBagCollectionSharder(fused_params=fused_params)]
        plan = EmbeddingShardingPlanner(
            topology=TopologyFactory.create_topology(
                TrainerConfig(world_size=world, local_world_size=world),
                kernel_config=KernelConfig(compute_device="cpu")),
            batch_size=case.batch).collective_plan(model, stock, dist.GroupMember.WORLD)
        if how == "stock_plan_torchrec":
            sharders = stock  # type: ignore[assignment]
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan,
                                   sharders=sharders)  # type: ignore[arg-type]
    if case.stock_tables() or how.startswith("stock_plan"):
        dmp.load_state_dict(initial)  # TorchRec's stock kernels do not keep the weights
    return dmp, _dense_sgd(dmp), dmp.plan


def _train(case: S.Case, rank: int, world: int, how: str) -> tuple[dict[str, Any], Any]:
    from torchrec.distributed import TrainPipelineSparseDist

    from torchrec_bagpipe.distributed import close_model

    dmp, opt, plan = _build(case, world, how)
    samples = S.make_samples(case.kind, case.steps, world, case.batch, case.seed)
    batches = S.batches_for(case.kind, samples, rank, case.seed, case.shuffle_keys)
    if case.loop == "torchrec":
        pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
        it = iter(batches)
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break
    else:
        for b in batches:
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
    state = S.full_state(dmp, rank)
    state.update(S.fused_state(opt))
    close_model(dmp)
    return state, plan


def _kernels(plan: Any) -> dict[str, str]:
    return {n: ps.compute_kernel for mp in plan.plan.values() for n, ps in mp.items()}


def _swaps(rank: int, world: int) -> list[str]:
    from torchrec_bagpipe.distributed import BAGPIPE_KERNEL

    torch.manual_seed(rank)
    problems: list[str] = []
    cases = [
        # DMP with only sharders=: DLRM-shaped, row-wise Adagrad in backward, TorchRec's
        # pipeline; every table on BagPipe (BagPipe first).
        ("dmp", S.Case(kind="dlrm", optimizer="rowwise_adagrad", loop="torchrec",
                       steps=STEPS, seed=3), {"t0", "t1", "t2"}),
        # A user-built TorchRec planner with constraints: b data-parallel, c table-wise.
        ("torchrec", S.Case(kind="mixed_ebc", optimizer="adagrad", steps=STEPS, seed=4),
         {"a", "d", "e"}),
        # TorchRec's plan helpers with bagpipe(): b dp, c table-wise, d row-wise.
        ("helpers", S.Case(kind="mixed_ebc", planner="hand", steps=STEPS, seed=5), {"a", "e"}),
    ]
    for how, case, on_bagpipe in cases:
        state, plan = _train(case, rank, world, how)
        got = {n for n, k in _kernels(plan).items() if k == BAGPIPE_KERNEL}
        if got != on_bagpipe:
            problems.append(f"{how}: BagPipe tables {sorted(got)} != {sorted(on_bagpipe)}")
        if rank == 0:
            problems += S.compare(state, S.train_reference(case, world), f"{how}: "
                                  f"{case.label()}", rtol=1e-4, atol=1e-5)
    # A plan by a stock planner without the BagPipe sharders, given to DMP with them: TorchRec's
    # own modules, trained exactly as with TorchRec's sharders.
    case = S.Case(kind="dlrm", steps=STEPS, seed=6)
    ours, plan = _train(case, rank, world, "stock_plan")
    theirs, _ = _train(case, rank, world, "stock_plan_torchrec")
    if _kernels(plan) and BAGPIPE_KERNEL in _kernels(plan).values():
        problems.append("the stock plan names the BagPipe kernel")
    problems += S.compare(ours, theirs, "stock plan with the BagPipe sharders", rtol=0, atol=0)
    return problems


def test_dmp_torchrec_planner_and_helpers_train_like_the_single_process_model():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_swaps, WORLD, env={"BAGPIPE_TEST_TMP": tmp}, timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


# ---- fused Adam + weight decay on an EC, dense Adam, StepLR: on CPU -------------------------
ADAM = {"lr": 0.02, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "wd": 0.05}
DENSE_ADAM_LR = 0.01
STEP_SIZE, GAMMA = 3, 0.5


def _lr(base: float, t: int) -> float:
    return base * GAMMA ** (t // STEP_SIZE)


def _adam_ec(rank: int, world: int) -> list[str]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import BAGPIPE_KERNEL, bagpipe_sharders, close_model

    torch.manual_seed(rank)
    case = S.Case(kind="ec", steps=STEPS, seed=9)
    fused = {"optimizer": EmbOptimType.ADAM, "learning_rate": ADAM["lr"],
             "beta1": ADAM["beta1"], "beta2": ADAM["beta2"], "eps": ADAM["eps"],
             "weight_decay": ADAM["wd"], "weight_decay_mode": WeightDecayMode.L2}
    # The size rule alone would keep these small tables stock: capability decides.
    sharders = bagpipe_sharders(BagPipeConfig(placement_min_rows=10**6), fused_params=fused)
    dmp = DistributedModelParallel(module=S.build_model("ec", case.seed),
                                   device=torch.device("cpu"), sharders=sharders)  # type: ignore[arg-type]
    problems = [f"{n} is not on BagPipe" for n, k in _kernels(dmp.plan).items()
                if k != BAGPIPE_KERNEL]
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.Adam(ps, lr=DENSE_ADAM_LR))
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=GAMMA)
    samples = S.make_samples("ec", case.steps, world, case.batch, case.seed)
    for b in S.batches_for("ec", samples, rank, case.seed):
        opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        opt.step()
        sched.step()
    state = S.full_state(dmp, rank)
    close_model(dmp)
    if rank == 0:
        problems += S.compare(state, _adam_reference(case, world), "ec adam", rtol=1e-4,
                              atol=1e-5)
    return problems


def _adam_reference(case: S.Case, world: int) -> dict[str, torch.Tensor]:
    """The single-process model: dense Adam + StepLR; the tables lazy Adam with L2 weight
    decay (rows the global batch reads), bias-corrected by the step count, as fbgemm."""
    model = S.build_model("ec", case.seed)
    tables = S.table_params(model)
    dense = [p for n, p in model.named_parameters() if not S._is_table(n)]
    dense_opt = torch.optim.Adam(dense, lr=DENSE_ADAM_LR)
    sched = torch.optim.lr_scheduler.StepLR(dense_opt, step_size=STEP_SIZE, gamma=GAMMA)
    m = {t: torch.zeros_like(p) for t, p in tables.items()}
    v = {t: torch.zeros_like(p) for t, p in tables.items()}
    features = {c.name: list(c.feature_names) for c in S.table_configs(model)}
    samples = S.make_samples("ec", case.steps, world, case.batch, case.seed)
    b1, b2, eps, wd = ADAM["beta1"], ADAM["beta2"], ADAM["eps"], ADAM["wd"]
    for t, b in enumerate(S.batches_for("ec", samples, None, case.seed)):
        dense_opt.zero_grad()
        for p in tables.values():
            p.grad = None
        loss, _ = model(b)
        loss.backward()
        dense_opt.step()
        sched.step()
        step = t + 1
        lr = _lr(ADAM["lr"], t) * (1 - b2**step) ** 0.5 / (1 - b1**step)
        with torch.no_grad():
            for name, p in tables.items():
                rows = torch.unique(torch.cat([b.sparse_features[f].values()
                                               for f in features[name]]))
                g = p.grad[rows] + wd * p[rows]
                m[name][rows] = m[name][rows] + (g - m[name][rows]) * (1 - b1)
                v[name][rows] = v[name][rows] + (g * g - v[name][rows]) * (1 - b2)
                p[rows] = p[rows] - m[name][rows] / (v[name][rows].sqrt() + eps) * lr
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ec_fused_adam_with_dense_adam_and_steplr_on_cpu():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_adam_ec, WORLD, env={"BAGPIPE_TEST_TMP": tmp}, timeout=600)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
