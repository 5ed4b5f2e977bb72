"""Models, data and training loops shared by the multi-process TorchRec tests.

Every scenario trains a DMP with BagPipe on W ranks and the same model unsharded in one
process on the concatenated global batch (mean loss), then compares every weight (and the
tables' optimizer state).

Kinds: `dlrm`, `weighted`, `mean` (every table on BagPipe); `mixed` (a second EBC on a stock
kernel); `mixed_ebc` / `mixed_weighted` (one EBC mixing BagPipe, data-parallel, table-wise
and row-wise tables, features shared across both sides); `ec` / `ec_mixed` (an
EmbeddingCollection: BagPipe only, or mixed likewise) under a sequence model.

The tables train with SGD, Adagrad, row-wise Adagrad or lazy Adam (`Case.optimizer`),
optionally under a learning-rate schedule (`Case.schedule`) that the training loop writes into
every param group of the model's fused optimizer (BagPipe's and the stock fused tables'); the
single-process reference uses torch's optimizers (Adagrad, torchrec's RowWiseAdagrad,
SparseAdam on the rows each global batch reads). Stock data-parallel tables train with the
dense optimizer, as in TorchRec.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import data_parallel, row_wise, table_wise
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed import (
    BagPipeShardingPlanner,
    BagPipeTrainPipeline,
    bagpipe_modules,
    bagpipe_plan,
    bagpipe_sharders,
    close_model,
    prescan_model,
)

DENSE_IN = 4
EMB_LR = 0.5
DENSE_LR = 0.1
SEQ_LEN = 3  # the longest bag make_samples draws (multi_hot)

# Stock placements of the mixed kinds (by hand: TorchRec's planner offers no row-wise
# sharding on CPU). Data-parallel stock tables train with the dense optimizer, as in TorchRec.
STOCK = {
    "mixed_ebc": {"b": data_parallel(), "c": table_wise(rank=1, compute_kernel="fused"),
                  "d": row_wise(compute_kernel="fused")},
    "mixed_weighted": {"b": data_parallel(), "c": table_wise(rank=0, compute_kernel="fused"),
                       "d": row_wise(compute_kernel="fused")},
    # TorchRec 1.9.2's own ShardedEmbeddingCollection fails when it mixes data-parallel with
    # other sharding types on CPU (a stock-only model too: its data-parallel lookup returns
    # one row per sample); the sequence tests mix table-wise and row-wise stock tables.
    "ec_mixed": {"b": table_wise(rank=0, compute_kernel="fused"),
                 "c": table_wise(rank=1, compute_kernel="fused"),
                 "d": row_wise(compute_kernel="fused")},
}
# The same kinds through the planner: constraints force these tables stock (the others go to
# BagPipe by size, placement_min_rows=0).
_DP = ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["dense"])
STOCK_CONSTRAINTS = {
    "mixed_ebc": {"b": _DP, "c": ParameterConstraints(sharding_types=["table_wise"],
                                                      compute_kernels=["fused"])},
    "ec_mixed": {"b": ParameterConstraints(sharding_types=["table_wise"],
                                           compute_kernels=["fused"]),
                 "c": ParameterConstraints(sharding_types=["row_wise"],
                                           compute_kernels=["fused"])},
}
STOCK_CONSTRAINTS["mixed_weighted"] = STOCK_CONSTRAINTS["mixed_ebc"]

# The single-process reference's optimizers (torch's; lazy Adam is SparseAdam on the rows a
# global batch reads) with the hyper-parameters every case uses, and their base lr.
BASE_LR = {"sgd": EMB_LR, "adagrad": 0.2, "rowwise_adagrad": 0.2, "adam": 0.02}

# How a case's tables get their optimizers, both of TorchRec's ways:
# name -> (the sharders' fused_params | None, the in-backward (class, kwargs) | None).
# `Case.table_optimizer` says which tables take the in-backward one.
OPTIMIZERS: dict[str, tuple[dict[str, Any] | None, tuple[type, dict[str, Any]] | None]] = {
    "sgd": ({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": EMB_LR}, None),
    "adagrad": ({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2, "eps": 1e-8},
                None),
    "rowwise_adagrad": (None, (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8})),
    "adam": (None, (torch.optim.Adam, {"lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-6})),
    # Two optimizers in one model (two fused tables of one dim): t0 row-wise Adagrad (in
    # backward), the other tables Adagrad (the sharders' fused_params).
    "mixed": ({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2, "eps": 1e-8},
              (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8})),
    # A mixed module: the BagPipe tables Adam (in backward), the stock fused tables Adagrad
    # (fused_params; fbgemm has no Adam on CPU).
    "adam_stock_adagrad": (
        {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2, "eps": 1e-8},
        (torch.optim.Adam, {"lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-6})),
}


def lr_factor(case: Case, t: int) -> float:
    """The factor of every table's base learning rate in force at step t: 1, or with
    `case.schedule` a warm-up from 0 and a decay that change it every 3 steps."""
    if not case.schedule:
        return 1.0
    phase = t // 3
    return 0.0 if phase == 0 else 1.0 if phase == 1 else 0.6 ** (phase - 1)


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
    if kind in ("mixed_ebc", "mixed_weighted"):
        weighted = kind == "mixed_weighted"
        pooling = PoolingType.SUM if weighted else PoolingType.MEAN
        return [
            # a, e: BagPipe; b: data-parallel; c: table-wise; d: row-wise (STOCK). f0 feeds a
            # BagPipe and a row-wise table, f1 a BagPipe and a data-parallel one, f2 a
            # table-wise and a BagPipe one.
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=50,
                               feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=20,
                               feature_names=["f1"]),
            EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=30,
                               feature_names=["f2"], pooling=pooling),
            EmbeddingBagConfig(name="d", embedding_dim=8, num_embeddings=40,
                               feature_names=["f3", "f0"]),
            EmbeddingBagConfig(name="e", embedding_dim=8, num_embeddings=25,
                               feature_names=["f2"], pooling=pooling),
        ], weighted
    if kind in ("ec", "ec_mixed"):
        tables = [
            EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=50,
                            feature_names=["f0", "f1"]),
            EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=20, feature_names=["f1"]),
            EmbeddingConfig(name="c", embedding_dim=4, num_embeddings=35, feature_names=["f2"]),
        ]
        if kind == "ec_mixed":
            tables.append(EmbeddingConfig(name="d", embedding_dim=4, num_embeddings=40,
                                          feature_names=["f3", "f0"]))
        return tables, False  # type: ignore[return-value]
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


class SequenceTower(nn.Module):
    """An EmbeddingCollection's sequences, weighted by a learned weight per position and
    summed, next to a dense tower (loss: mean BCE): every id's embedding gets its own
    gradient, as sequence models give it."""

    def __init__(self, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.ec = ec
        self.names = [n for names in ec.embedding_names_by_table() for n in names]
        self.position = nn.Parameter(torch.linspace(1.0, 0.4, SEQ_LEN))
        self.dense = nn.Linear(DENSE_IN, 4)
        self.over = nn.Linear(len(self.names) * ec.embedding_dim() + 4, 1)
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        sequences = self.ec(batch.sparse_features)
        parts = [
            (sequences[n].to_padded_dense(desired_length=SEQ_LEN)
             * self.position.view(1, SEQ_LEN, 1)).sum(dim=1)
            for n in self.names
        ]
        x = torch.cat([*parts, torch.relu(self.dense(batch.dense_features))], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_model(kind: str, seed: int, meta: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    tables, weighted = tables_for(kind)
    device = torch.device("meta") if meta else None
    if kind.startswith("ec"):
        ec = EmbeddingCollection(tables=tables, device=device)  # type: ignore[arg-type]
        torch.manual_seed(seed + 1)
        return SequenceTower(ec)
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
    loop: str = "plain"  # plain | pipeline (BagPipe's) | torchrec (TrainPipelineSparseDist)
    steps: int = 20
    batch: int = 8
    seed: int = 0
    planner: str = "planner"  # planner | hand
    meta: bool = False
    optimizer: str = "sgd"  # a key of OPTIMIZERS
    schedule: bool = False  # the tables' lr changes every few steps (lr_factor)

    @property
    def shuffle_keys(self) -> bool:
        # TorchRec's stock sharded EBC (the mixed model's second EBC) needs one fixed key
        # order; the stock part of a BagPipe-sharded module is fed one order whatever comes.
        return self.kind != "mixed"

    @property
    def stock(self) -> dict[str, Any]:
        """Hand-planned stock tables (the planner's are STOCK_CONSTRAINTS)."""
        return STOCK.get(self.kind, {}) if self.planner == "hand" else {}

    def dense_tables(self) -> set[str]:
        """Stock data-parallel tables: the dense optimizer trains them."""
        return {"b"} if self.kind in ("mixed_ebc", "mixed_weighted") else set()

    def stock_tables(self) -> set[str]:
        """The tables the case's plan keeps on stock TorchRec sharding."""
        if self.kind == "mixed":
            return {"local"} if self.planner == "planner" else set()
        if self.planner == "hand":
            return set(STOCK.get(self.kind, {}))
        return set(STOCK_CONSTRAINTS.get(self.kind, {}))

    def table_optimizer(self, table: str) -> str:
        """The optimizer (a key of BASE_LR) `table` trains with, if the fused optimizer
        trains it."""
        if self.optimizer == "mixed":
            return "rowwise_adagrad" if table == "t0" else "adagrad"
        if self.optimizer == "adam_stock_adagrad":
            return "adagrad" if table in self.stock_tables() else "adam"
        return self.optimizer

    def in_backward(self, table: str) -> bool:
        """Whether `table` gets the case's in-backward optimizer."""
        if table in self.dense_tables() or OPTIMIZERS[self.optimizer][1] is None:
            return False
        cls = OPTIMIZERS[self.optimizer][1][0]  # type: ignore[index]
        kind = {RowWiseAdagrad: "rowwise_adagrad", torch.optim.Adam: "adam"}[cls]
        return self.table_optimizer(table) == kind

    def label(self) -> str:
        sched = "+schedule" if self.schedule else ""
        return f"{self.kind}/{self.loop}/{self.optimizer}{sched}/{self.config}"


def make_dmp(case: Case, model: nn.Module, world: int) -> tuple[DistributedModelParallel, Any]:
    # Small test tables go to BagPipe unless a case places them otherwise.
    config = BagPipeConfig(**{"placement_min_rows": 0, **case.config})
    initial = None if case.meta else {k: v.clone() for k, v in model.state_dict().items()}
    fused_params, in_backward = OPTIMIZERS[case.optimizer]
    if in_backward is not None:
        params = [p for t, p in table_params(model).items() if case.in_backward(t)]
        apply_optimizer_in_backward(in_backward[0], params, dict(in_backward[1]))
    sharders = bagpipe_sharders(config, fused_params=fused_params)
    constraints = None
    if case.kind == "mixed":
        constraints = {"local": ParameterConstraints(sharding_types=["table_wise"],
                                                     compute_kernels=["fused"])}
    elif case.kind in STOCK:
        constraints = dict(STOCK_CONSTRAINTS[case.kind])
    if case.planner == "hand":
        plan = bagpipe_plan(model, world, stock=case.stock)
    else:
        planner = BagPipeShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"), batch_size=case.batch,
            constraints=constraints,
        )
        plan = planner.collective_plan(model, sharders)  # type: ignore[arg-type]
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=sharders)  # type: ignore[arg-type]
    if initial is not None and (case.kind == "mixed" or case.kind in STOCK):
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
    # Every embedding table's param group (BagPipe's and the stock fused tables'), as an LR
    # scheduler over the model's fused optimizer sees them, with its base lr.
    fused_groups = list(dmp.fused_optimizer.param_groups)
    base_lrs = [float(g["lr"]) for g in fused_groups]

    def set_lr(t: int) -> None:  # the schedule, as an LR scheduler writes it
        for g, base in zip(fused_groups, base_lrs):
            g["lr"] = base * lr_factor(case, t)

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
        if case.loop == "pipeline":
            pipe = BagPipeTrainPipeline(dmp, opt, torch.device("cpu"),
                                        prescan_batches=batches if prescan else None)
        else:  # "torchrec": TorchRec's own pipeline, input dist a batch early
            if prescan:
                prescan_model(dmp, batches)
            pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
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
        # The pipeline really ran every BagPipe-sharded module's input dist ahead.
        pipelined = pipe._pipelined_modules
        assert all(any(m is p for p in pipelined) for _, m in bagpipe_modules(dmp)), pipelined
    state = full_state(dmp, rank)
    state.update(fused_state(opt))
    if case.config.get("bagpipe_aggregation") == "writeback":
        # The caches owned their rows: the state read above had them written back.
        from torchrec_bagpipe.distributed import bagpipe_metrics

        metrics = bagpipe_metrics(dmp).values()
        assert metrics and all(m["flushed_rows"] > 0 for m in metrics), list(metrics)
    close_model(dmp)
    return state, losses


def fused_state(opt: Any) -> dict[str, torch.Tensor]:
    """The tables' optimizer state from the fused optimizer's state_dict, as
    ``"opt:<table>.<entry>"`` tensors (TorchRec's layout: momentum1, exp_avg_sq, step).

    Stock fused tables' state is sharded (a table-wise table's only on its rank): every
    rank's local shards are gathered into whole tensors on every rank (a collective under
    torch.distributed: every rank calls it)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, torch.Tensor] = {}
    shards: list[tuple[str, tuple[int, ...], list[int], torch.Tensor]] = []
    for _param_key, entries in opt.state_dict()["state"].items():
        for name, value in entries.items():
            if isinstance(value, ShardedTensor):
                shards.extend((name, tuple(value.size()), list(s.metadata.shard_offsets),
                               s.tensor.detach().clone()) for s in value.local_shards())
            elif isinstance(value, torch.Tensor):
                out[f"opt:{name}"] = value.detach().clone()
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, shards)
        shards = [s for rank_shards in gathered for s in rank_shards]
    for name, size, offsets, tensor in shards:
        full = out.setdefault(f"opt:{name}", torch.zeros(size))
        full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
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


def whole_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict as whole tensors on every rank (a collective): each sharded
    tensor's local shards (BagPipe tables, stock sharded tables) summed across the ranks."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for k, v in module.state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.zeros(v.size())
            for shard in v.local_shards():
                rows = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets,
                                                              shard.metadata.shard_sizes))
                full[rows] = shard.tensor.clone()
            if dist.is_initialized():
                dist.all_reduce(full)
            v = full
        out[k] = v.detach().clone()
    return out


def train_reference(case: Case, world: int, init: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    model = build_model(case.kind, case.seed)
    if init is not None:
        # The dense layers start from the same seed; the tables from `init`.
        model.load_state_dict({**model.state_dict(),
                               **{k: v for k, v in init.items() if _is_table(k)}})
    samples = make_samples(case.kind, case.steps, world, case.batch, case.seed)
    batches = batches_for(case.kind, samples, None, case.seed, case.shuffle_keys)
    dp = set(case.dense_tables())
    tables = {t: p for t, p in table_params(model).items() if t not in dp}
    dense = [p for n, p in model.named_parameters()
             if not _is_table(n) or n.split(".")[-2] in dp]
    # Without TorchRec's gradient division the PS sums the ranks' gradients: W times the
    # gradient of the global mean loss.
    scale = world if case.config.get("gradient_division") is False else 1
    dense_opt = torch.optim.SGD(dense, lr=DENSE_LR)
    by_optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for t, p in tables.items():
        by_optimizer.setdefault(case.table_optimizer(t), {})[t] = p
    emb_opts = {name: _reference_optimizer(name, list(ts.values()))
                for name, ts in by_optimizer.items()}
    features = {c.name: list(c.feature_names) for c in table_configs(model)}
    for t, b in enumerate(batches):
        for name, o in emb_opts.items():
            for g in o.param_groups:
                g["lr"] = BASE_LR[name] * lr_factor(case, t) * scale
        dense_opt.zero_grad()
        for o in emb_opts.values():
            o.zero_grad()
        loss, _ = model(b)
        loss.backward()
        for table, p in by_optimizer.get("adam", {}).items():
            # Lazy Adam: only the rows the global batch reads take a step.
            rows = torch.unique(torch.cat([b.sparse_features[f].values()
                                           for f in features[table]]))
            p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), p.grad[rows], p.shape)
        dense_opt.step()
        for o in emb_opts.values():
            o.step()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, o in emb_opts.items():
        out.update(_reference_state(name, o, by_optimizer[name]))
    return out


def _reference_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    lr = BASE_LR[name]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=1e-8)
    if name == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, eps=1e-8)
    return torch.optim.SparseAdam(params, lr=lr, betas=(0.9, 0.99), eps=1e-6)


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


def table_configs(model: nn.Module) -> list[Any]:
    """The configs of every table of the model's EBCs and ECs."""
    out: list[Any] = []
    for m in model.modules():
        if isinstance(m, EmbeddingBagCollection):
            out.extend(m.embedding_bag_configs())
        elif isinstance(m, EmbeddingCollection):
            out.extend(m.embedding_configs())
    return out


def table_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Table name -> its weight, for every table of the model's EBCs and ECs."""
    return {n.split(".")[-2]: p for n, p in model.named_parameters() if _is_table(n)}


def _is_table(name: str) -> bool:
    return "embedding_bags." in name or "embeddings." in name


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
            rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Problems of `got` against `want`, by key. A ShardedTensor (a BagPipe table's live
    state-dict tensor, a stock sharded table) is compared by this rank's local shards."""
    problems = []
    if set(got) != set(want):
        problems.append(f"{label}: keys differ: {sorted(set(got) ^ set(want))}")
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.shape != b.shape:
            problems.append(f"{label}: {k} shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        for x, y in _local_pairs(a, b):
            if not torch.allclose(x, y, rtol=rtol, atol=atol):
                err = (x - y).abs().max().item()
                problems.append(f"{label}: {k} differs (max abs err {err:.3g})")
                break
    return problems


def _local_pairs(a: torch.Tensor, b: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain tensor pairs to compare: whole tensors, or the local shards of a sharded one
    with the same block of the other (sharded the same way, or whole)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    def shards(t: torch.Tensor) -> dict[tuple[int, ...], torch.Tensor]:
        return {tuple(s.metadata.shard_offsets): s.tensor.detach().clone()
                for s in t.local_shards()}  # type: ignore[attr-defined]

    def block(t: torch.Tensor, offsets: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return t[tuple(slice(o, o + n) for o, n in zip(offsets, like.shape))]

    if isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor):
        sa, sb = shards(a), shards(b)
        if set(sa) != set(sb):
            return [(torch.zeros(1), torch.ones(1))]  # differently sharded: a difference
        return [(sa[o], sb[o]) for o in sa]
    if isinstance(a, ShardedTensor):
        return [(x, block(b, o, x)) for o, x in shards(a).items()]
    if isinstance(b, ShardedTensor):
        return [(block(a, o, y), y) for o, y in shards(b).items()]
    return [(a, b)]
