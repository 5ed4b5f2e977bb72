"""Models, data and training loops shared by the multi-process TorchRec tests.

Every scenario trains a DMP with BagPipe on W ranks and the same model unsharded in one
process on the concatenated global batch (mean loss), then compares every weight (and the
tables' optimizer state). The tables train with SGD, Adagrad, row-wise Adagrad or lazy Adam
(`Case.optimizer`), optionally under a learning-rate schedule (`Case.schedule`); the
single-process reference uses torch's optimizers (Adagrad, torchrec's RowWiseAdagrad,
SparseAdam on the rows each global batch reads).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed import (
    BagPipeEmbeddingBagCollectionSharder,
    BagPipeShardingPlanner,
    BagPipeTrainPipeline,
    bagpipe_plan,
    close_model,
    prescan_model,
)

DENSE_IN = 4
EMB_LR = 0.5
DENSE_LR = 0.1

# How each optimizer reaches BagPipe (both of TorchRec's ways), its base learning rate, and
# the single-process reference: (fused_params | None, (class, kwargs) | None, base lr).
OPTIMIZERS: dict[str, tuple[dict[str, Any] | None, tuple[type, dict[str, Any]] | None,
                            float]] = {
    "sgd": ({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": EMB_LR}, None, EMB_LR),
    "adagrad": ({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2, "eps": 1e-8},
                None, 0.2),
    "rowwise_adagrad": (None, (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}), 0.2),
    "adam": (None, (torch.optim.Adam, {"lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-6}), 0.02),
    # Two optimizers in one model (two fused tables of one dim): t0 row-wise Adagrad (in
    # backward), the other tables Adagrad (the sharder's fused_params).
    "mixed": ({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2, "eps": 1e-8},
              (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}), 0.2),
}


def emb_lr(case: Case, t: int) -> float:
    """The tables' learning rate in force at step t: the optimizer's base rate, or with
    `case.schedule` a warm-up from 0 and a decay that change it every 3 steps."""
    base = OPTIMIZERS[case.optimizer][2]
    if not case.schedule:
        return base
    phase = t // 3
    return base * (0.0 if phase == 0 else 1.0 if phase == 1 else 0.6 ** (phase - 1))


# ---- models ------------------------------------------------------------------------------
def tables_for(kind: str) -> tuple[list[EmbeddingBagConfig], bool]:
    """(tables, is_weighted) of a test model."""
    if kind == "dlrm":
        return [
            EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=40, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=30, feature_names=["f1"]),
            EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=25, feature_names=["f2"],
                               pooling=PoolingType.MEAN),
        ], False
    if kind == "weighted":
        return [
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=50,
                               feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=20, feature_names=["f1"]),
            EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=35, feature_names=["f2"]),
        ], True
    if kind == "mixed":  # "local" stays on TorchRec's stock kernel (a second EBC)
        return [
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=50,
                               feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="local", embedding_dim=4, num_embeddings=30,
                               feature_names=["f2"]),
        ], False
    if kind == "mean":
        return [
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=50,
                               feature_names=["f0", "f1"], pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=20, feature_names=["f1"]),
            EmbeddingBagConfig(name="c", embedding_dim=6, num_embeddings=70, feature_names=["f2"],
                               pooling=PoolingType.MEAN),
        ], False
    raise ValueError(kind)


class TwoTower(nn.Module):
    """EBCs and a dense tower joined by a linear head (loss: mean BCE)."""

    def __init__(self, ebc: EmbeddingBagCollection,
                 other: EmbeddingBagCollection | None = None) -> None:
        super().__init__()
        self.ebc = ebc
        self.other = other
        width = sum(c.embedding_dim * len(c.feature_names)
                    for e in (ebc, other) if e is not None for c in e.embedding_bag_configs())
        self.dense = nn.Linear(DENSE_IN, 4)
        self.over = nn.Linear(width + 4, 1)
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        parts = [self.ebc(batch.sparse_features).values()]
        if self.other is not None:
            parts.append(self.other(batch.sparse_features).values())
        x = torch.cat([*parts, torch.relu(self.dense(batch.dense_features))], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_model(kind: str, seed: int, meta: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    tables, weighted = tables_for(kind)
    device = torch.device("meta") if meta else None
    if kind == "mixed":
        first = EmbeddingBagCollection(tables=tables[:1], is_weighted=weighted, device=device)
        second = EmbeddingBagCollection(tables=tables[1:], is_weighted=weighted, device=device)
        torch.manual_seed(seed + 1)  # dense layers: the same whether the tables are meta
        return TwoTower(first, second)
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=device)
    torch.manual_seed(seed + 1)
    if kind == "dlrm":
        return DLRMTrain(
            DLRM(
                embedding_bag_collection=ebc,
                dense_in_features=DENSE_IN,
                dense_arch_layer_sizes=[8, 8],
                over_arch_layer_sizes=[8, 1],
            )
        )
    return TwoTower(ebc)


# ---- data ------------------------------------------------------------------------------------
@dataclass
class Sample:
    ids: dict[str, list[int]]
    weights: dict[str, list[float]]
    dense: list[float]
    label: float


def _sample(rng: random.Random, sizes: dict[str, int], multi_hot: int) -> Sample:
    ids: dict[str, list[int]] = {}
    weights: dict[str, list[float]] = {}
    for f, n in sizes.items():
        k = rng.randint(0, multi_hot)
        # Skewed ids so batches share rows (cache hits, duplicate ids within a bag).
        ids[f] = [min(n - 1, int(n * rng.random() ** 3)) for _ in range(k)]
        weights[f] = [round(rng.uniform(0.5, 1.5), 3) for _ in range(k)]
    return Sample(ids, weights, [rng.uniform(-1, 1) for _ in range(DENSE_IN)],
                  float(rng.random() < 0.4))


def feature_sizes(kind: str) -> dict[str, int]:
    """Every feature of the model with its smallest table size, plus an unused feature."""
    tables, _ = tables_for(kind)
    sizes: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            sizes[f] = min(sizes.get(f, t.num_embeddings), t.num_embeddings)
    sizes["unused"] = 1000
    return sizes


def make_samples(kind: str, steps: int, world: int, batch: int, seed: int,
                 multi_hot: int = 3) -> list[list[list[Sample]]]:
    """samples[step][rank] = that rank's local batch."""
    rng = random.Random(seed)
    sizes = feature_sizes(kind)
    return [[[_sample(rng, sizes, multi_hot) for _ in range(batch)] for _ in range(world)]
            for _ in range(steps)]


def to_batch(samples: list[Sample], keys: list[str], weighted: bool) -> Batch:
    lengths, values, weights = [], [], []
    for k in keys:
        for s in samples:
            lengths.append(len(s.ids[k]))
            values.extend(s.ids[k])
            weights.extend(s.weights[k])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=torch.tensor(weights, dtype=torch.float32) if weighted else None,
    )
    return Batch(
        dense_features=torch.tensor([s.dense for s in samples], dtype=torch.float32),
        sparse_features=kjt,
        labels=torch.tensor([s.label for s in samples], dtype=torch.float32),
    )


def batches_for(kind: str, samples: list[list[list[Sample]]], rank: int | None,
                seed: int, shuffle_keys: bool = True) -> list[Batch]:
    """Local batches of `rank` (None: the global batches), keys in a shuffled order
    (TorchRec's stock sharded EBC needs one fixed key order: shuffle_keys=False)."""
    _, weighted = tables_for(kind)
    rng = random.Random(seed + 7)
    keys = list(feature_sizes(kind))
    out = []
    for step in samples:
        if shuffle_keys:
            rng.shuffle(keys)
        chosen = step[rank] if rank is not None else [s for r in step for s in r]
        out.append(to_batch(chosen, list(keys), weighted))
    return out


# ---- training --------------------------------------------------------------------------------
@dataclass
class Case:
    kind: str = "dlrm"
    config: dict[str, Any] = field(default_factory=dict)
    loop: str = "plain"  # plain | pipeline
    steps: int = 20
    batch: int = 8
    seed: int = 0
    planner: str = "planner"  # planner | hand
    meta: bool = False
    optimizer: str = "sgd"  # a key of OPTIMIZERS
    schedule: bool = False  # the tables' lr changes every few steps (emb_lr)

    @property
    def shuffle_keys(self) -> bool:
        # TorchRec's stock sharded EBC (in the mixed model) needs one fixed key order.
        return self.kind != "mixed"

    def label(self) -> str:
        sched = "+schedule" if self.schedule else ""
        return f"{self.kind}/{self.loop}/{self.optimizer}{sched}/{self.config}"


def make_dmp(case: Case, model: nn.Module, world: int) -> tuple[DistributedModelParallel, Any]:
    config = BagPipeConfig(**case.config)
    initial = None if case.meta else {k: v.clone() for k, v in model.state_dict().items()}
    fused_params, in_backward, _ = OPTIMIZERS[case.optimizer]
    if in_backward is not None:
        ebcs = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
        params = [p for e in ebcs for n, p in e.named_parameters()
                  if case.optimizer != "mixed" or n.startswith("embedding_bags.t0.")]
        apply_optimizer_in_backward(in_backward[0], params, dict(in_backward[1]))
    sharder = BagPipeEmbeddingBagCollectionSharder(config, fused_params=fused_params)
    constraints = None
    if case.kind == "mixed":
        constraints = {"local": ParameterConstraints(sharding_types=["table_wise"],
                                                     compute_kernels=["fused"])}
    if case.planner == "hand" and constraints is None:
        plan = bagpipe_plan(model, world)
    else:
        planner = BagPipeShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"), batch_size=case.batch,
            constraints=constraints,
        )
        plan = planner.collective_plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=[sharder])
    if case.kind == "mixed":
        # TorchRec's stock kernels do not keep the module's weights; BagPipe tables do.
        dmp.load_state_dict(initial)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=DENSE_LR),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def train_dmp(case: Case, rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build_model(case.kind, case.seed, meta=case.meta)
    dmp, opt = make_dmp(case, model, world)
    samples = make_samples(case.kind, case.steps, world, case.batch, case.seed)
    batches = batches_for(case.kind, samples, rank, case.seed, case.shuffle_keys)
    prescan = bool(case.config.get("optimization_prescan"))
    losses: list[float] = []
    fused_groups = [g for g in opt.param_groups if "fused_table" in g]

    def set_lr(t: int) -> None:  # the schedule, as an LR scheduler writes it
        for g in fused_groups:
            g["lr"] = emb_lr(case, t)

    if case.loop == "plain":
        if prescan:
            prescan_model(dmp, batches)
        for t, b in enumerate(batches):
            set_lr(t)
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    else:
        pipe = BagPipeTrainPipeline(dmp, opt, torch.device("cpu"),
                                    prescan_batches=batches if prescan else None)
        it = iter(batches)
        t = 0
        while True:
            set_lr(t)  # progress(it) runs the backward of step t
            try:
                output = pipe.progress(it)
            except StopIteration:
                break
            losses.append(float(output[0]))
            t += 1
    state = full_state(dmp, rank)
    state.update(fused_state(opt))
    close_model(dmp)
    return state, losses


def fused_state(opt: Any) -> dict[str, torch.Tensor]:
    """The tables' optimizer state from the fused optimizer's state_dict, as
    ``"opt:<table>.<entry>"`` tensors (TorchRec's layout: momentum1, exp_avg_sq, step)."""
    out = {}
    for _param_key, entries in opt.state_dict()["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                out[f"opt:{name}"] = value.detach().clone()
    return out


def full_state(dmp: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The DMP's state dict with stock ShardedTensors gathered on rank 0."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.empty(v.size()) if rank == 0 else None
            v.gather(0, full)
            v = full
        if v is not None:
            out[k] = v.detach().clone()
    return out


def train_reference(case: Case, world: int, init: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    model = build_model(case.kind, case.seed)
    if init is not None:
        # The dense layers start from the same seed; the tables from `init`.
        model.load_state_dict({**model.state_dict(),
                               **{k: v for k, v in init.items() if "embedding_bags" in k}})
    samples = make_samples(case.kind, case.steps, world, case.batch, case.seed)
    batches = batches_for(case.kind, samples, None, case.seed, case.shuffle_keys)
    tables = {n.split(".")[-2]: p for n, p in model.named_parameters() if "embedding_bags" in n}
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    # Without TorchRec's gradient division the PS sums the ranks' gradients: W times the
    # gradient of the global mean loss.
    scale = world if case.config.get("gradient_division") is False else 1
    dense_opt = torch.optim.SGD(dense, lr=DENSE_LR)
    if case.optimizer == "mixed":
        emb_opt = torch.optim.Adagrad(
            [p for n, p in tables.items() if n != "t0"], lr=0.2, eps=1e-8)
        row_opt: torch.optim.Optimizer | None = RowWiseAdagrad([tables["t0"]], lr=0.2,
                                                               eps=1e-8)
    else:
        emb_opt = _reference_optimizer(case.optimizer, list(tables.values()))
        row_opt = None
    emb_opts = [emb_opt] + ([row_opt] if row_opt is not None else [])
    features = {c.name: list(c.feature_names)
                for m in model.modules() if isinstance(m, EmbeddingBagCollection)
                for c in m.embedding_bag_configs()}
    for t, b in enumerate(batches):
        for o in emb_opts:
            for g in o.param_groups:
                g["lr"] = emb_lr(case, t) * scale
        dense_opt.zero_grad()
        for o in emb_opts:
            o.zero_grad()
        loss, _ = model(b)
        loss.backward()
        if isinstance(emb_opt, torch.optim.SparseAdam):
            # Lazy Adam: only the rows the global batch reads take a step.
            for name, p in tables.items():
                rows = torch.unique(torch.cat([b.sparse_features[f].values()
                                               for f in features[name]]))
                p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), p.grad[rows], p.shape)
        dense_opt.step()
        for o in emb_opts:
            o.step()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if row_opt is not None:
        out.update(_reference_state("adagrad", emb_opt,
                                    {n: p for n, p in tables.items() if n != "t0"}))
        out.update(_reference_state("rowwise_adagrad", row_opt, {"t0": tables["t0"]}))
    else:
        out.update(_reference_state(case.optimizer, emb_opt, tables))
    return out


def _reference_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=EMB_LR)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.2, eps=1e-8)
    if name == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=0.2, eps=1e-8)
    return torch.optim.SparseAdam(params, lr=0.02, betas=(0.9, 0.99), eps=1e-6)


def _reference_state(name: str, opt: torch.optim.Optimizer,
                     tables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference optimizer's state in `fused_state`'s naming."""
    out: dict[str, torch.Tensor] = {}
    for table, p in tables.items():
        st = opt.state.get(p, {})
        if name in ("adagrad", "rowwise_adagrad"):
            out[f"opt:{table}.momentum1"] = st["sum"].detach().clone().reshape(
                p.shape[0], -1).squeeze(1) if name == "rowwise_adagrad" else st["sum"].clone()
        elif name == "adam":
            out[f"opt:{table}.momentum1"] = st["exp_avg"].to_dense().clone()
            out[f"opt:{table}.exp_avg_sq"] = st["exp_avg_sq"].to_dense().clone()
            out[f"opt:{table}.step"] = torch.tensor(int(st["step"]), dtype=torch.int64)
    return out


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
            rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    problems = []
    if set(got) != set(want):
        problems.append(f"{label}: keys differ: {sorted(set(got) ^ set(want))}")
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.shape != b.shape:
            problems.append(f"{label}: {k} shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            err = (a - b).abs().max().item()
            problems.append(f"{label}: {k} differs (max abs err {err:.3g})")
    return problems

