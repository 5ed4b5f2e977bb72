"""Virtual tables (issue 22): memory under eviction, and model quality at equal memory.

Part 1 (memory, metric ``live_rows`` and ``bytes``). A drifting Zipf stream (benchmarks/
traces.py ``drifting``: the hot set moves through half of each feature's 2^30-id space over
the run, so new ids keep arriving) trains an `EmbeddingStore` keyed by raw ids, step by step,
with the native eviction rule (`C.EvictionRule`, the one the runtime's step planner runs)
erasing what it evicts at each boundary. Config ``virtual``: TorchRec's
`CountBasedEvictionPolicy` semantics (threshold, decay, trigger = the memory bound);
baseline ``virtual_no_eviction``: the same table without a policy (it grows with every new id).
Lines report the store's live rows and resident bytes at a few steps and their maximum.

Part 2 (quality, metrics ``auroc`` and ``collision_rate``). Raw-id Criteo-format data
(`PowerLawCriteoDataset` with 2^30 ids per feature: no ``% num_embeddings`` hashing upstream)
trains the same small model (dense features and pooled embeddings -> MLP -> click logit) with
three embedding layers of the same memory (M rows per feature):

* ``virtual``: rows keyed by raw id on an `EmbeddingStore`, the count rule with the trigger
  at M rows per feature (reads of absent ids are their initial value; nothing collides);
* ``hashed``: a fixed table of M rows per feature, slot = id mod M;
* ``mch``: TorchRec's `ManagedCollisionEmbeddingBagCollection` with `MCHManagedCollisionModule`
  (zch_size M, `DistanceLFU_EvictionPolicy`, eviction interval 1).

AUROC is measured on a held-out stream of the same distribution (baseline: ``hashed``).
`collision_rate` is the fraction of held-out lookups served a row that another id trained or
owns: hashed, some other training id has the same slot; mch, the id is not resident in the
module's remapping table; virtual, 0 by construction (an id has its own row or its initial
value), reported as 0.

Part 3 (the store, metric ``keys_per_s``). The rates of a virtual table's three store
operations on raw ids spread over [0, 2^40), with 1 and 2 store threads (baseline: 1 thread):
``insert`` (`lookup(insert_missing=True)` of new ids), ``find`` (`lookup` of live ids) and
``evict`` (`erase` of live ids).

Part 4 (throughput, metric ``steps_per_s``). The DLRM example (`examples/dlrm`, 2 gloo ranks,
every table on BagPipe, the same cache size and lookahead) trains `--tp-steps` batches of its
synthetic Zipf data: config ``virtual`` with ``--virtual_tables`` (raw ids from a 2^31-id
space per feature, rows created on first touch, no key bound: the cache metadata's hash
index and the PS's unbounded keys; a step TTL no row reaches, so the eviction rule runs every
step as for a table that evicts), ``virtual_no_eviction`` (the same without a policy: no
rule), baseline ``fixed``: plain BagPipe tables over the same raw
ids (``--num_embeddings`` 2^31 - 1: the same data, and the PS stores only the rows trained,
so the same rows are live; checked: both read the same rows). The two run round robin,
`--repeats` times; the value is the median training steps/s (the example's
``samples_per_s`` over the global batch); `ratio` virtual / fixed (target >= 0.9).

Each number is the median over `--repeats` seeds (part 4: runs). One JSON line per result:
{"bench","metric","value","unit","baseline","ratio","config",...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from traces import make_trace  # benchmarks/traces.py

from torchrec_bagpipe._native import C
from torchrec_bagpipe.datasets import PowerLawCriteoDataset
from torchrec_bagpipe.ps import EmbeddingStore
from torchrec_bagpipe.runtime.eviction import EvictionSpec

RAW_IDS = 1 << 30  # raw id space per feature (PowerLawCriteoDataset's scatter needs < 2^31)
FEATURE_BITS = 31  # fused key = feature << FEATURE_BITS | raw id
INIT_BOUND = 0.05


def emit(**kw: object) -> None:
    print(json.dumps({"bench": "virtual_tables", **kw}), flush=True)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the Mann-Whitney statistic with tied scores averaged."""
    s = scores.double().flatten()
    y = labels.flatten() > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        raise ValueError("AUROC needs both classes")
    order = torch.argsort(s)
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    uniq, inv = torch.unique(s, return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, ranks)
    counts = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, torch.ones_like(s))
    avg = (sums / counts)[inv]
    return float((avg[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def fused_keys(values: torch.Tensor, features: int, batch: int) -> torch.Tensor:
    """KJT values (feature-major, one id per sample) -> fused keys feature << 31 | id."""
    f = torch.arange(features, dtype=torch.int64).repeat_interleave(batch)
    return (f << FEATURE_BITS) | values.to(torch.int64)


def count_spec(bound_rows: int) -> EvictionSpec:
    """TorchRec's CountBasedEvictionPolicy(eviction_threshold=1, decay_rate=0.9,
    training_id_eviction_trigger_count=bound_rows) on one rank: while live rows exceed the
    bound, a row read in fewer than ~1 in 10 steps lately is evicted."""
    return EvictionSpec(threshold=1.0, decay_rate=0.9, trigger_rows=bound_rows)


class VirtualStore:
    """A virtual table's rows on an EmbeddingStore, evicted by the native rule (the PS side
    of `use_virtual_table=True`, without the transport)."""

    def __init__(self, dim: int, spec: EvictionSpec, seed: int) -> None:
        self.store = EmbeddingStore(dim=dim, init="uniform", init_bound=INIT_BOUND, seed=seed,
                                    key_bound=1 << 40)
        self.spec = spec
        self.rule = C.EvictionRule(spec.native()) if spec.tracks else None
        self.step = 0

    def read(self, keys: torch.Tensor) -> torch.Tensor:
        return self.store.lookup(keys, insert_missing=False)

    def train(self, keys: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        self.store.apply_gradients(keys, grads, lr)
        if self.rule is not None:
            evicted = self.rule.on_step(self.step, torch.unique(keys).numpy())
            if len(evicted):
                self.store.erase(torch.from_numpy(np.asarray(evicted, dtype=np.int64)))
        self.step += 1

    def live(self) -> int:
        return len(self.store)

    def bytes(self) -> int:
        return int(self.store.stats()["bytes_resident"])


# ---- part 1: memory over steps ------------------------------------------------------------
def memory_run(spec: EvictionSpec, steps: int, batch: int, features: int, dim: int,
               seed: int) -> list[tuple[int, int]]:
    """(live rows, resident bytes) after each step of the drifting stream."""
    trace = make_trace("drifting", RAW_IDS * features, steps, batch, seed, features=features)
    table = VirtualStore(dim, spec, seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        keys = torch.from_numpy(trace[t][0])
        table.train(keys, torch.randn(keys.numel(), dim, generator=g) * 0.01, 0.1)
        out.append((table.live(), table.bytes()))
    return out


def part_memory(args: argparse.Namespace) -> None:
    bound = args.bound_rows * args.features
    configs = {"virtual": count_spec(bound), "virtual_no_eviction": EvictionSpec()}
    runs = {name: [memory_run(spec, args.mem_steps, args.batch, args.features, args.dim,
                              seed) for seed in range(args.repeats)]
            for name, spec in configs.items()}
    marks = sorted({args.mem_steps // 4 - 1, args.mem_steps // 2 - 1, args.mem_steps - 1})
    for t in marks:
        for metric, idx, unit in (("live_rows", 0, "rows"), ("bytes", 1, "B")):
            base = median([r[t][idx] for r in runs["virtual_no_eviction"]])
            val = median([r[t][idx] for r in runs["virtual"]])
            emit(metric=metric, value=val, unit=unit, baseline=base, ratio=val / base,
                 config="virtual", baseline_config="virtual_no_eviction", step=t + 1,
                 trigger_rows=bound, stream="drifting")
    for metric, idx, unit in (("max_live_rows", 0, "rows"), ("max_bytes", 1, "B")):
        base = median([max(x[idx] for x in r) for r in runs["virtual_no_eviction"]])
        val = median([max(x[idx] for x in r) for r in runs["virtual"]])
        emit(metric=metric, value=val, unit=unit, baseline=base, ratio=val / base,
             config="virtual", baseline_config="virtual_no_eviction", steps=args.mem_steps,
             trigger_rows=bound, new_ids_per_step=args.batch * args.features,
             stream="drifting")


# ---- part 2: quality at equal memory -------------------------------------------------------
class Tower(nn.Module):
    def __init__(self, num_dense: int, features: int, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(num_dense + features * dim, 32), nn.ReLU(),
                                 nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([dense, pooled], 1)).squeeze(1)


class Embedder:
    """forward(batch) -> [B, F * D] pooled embeddings; step(lr) applies its sparse update;
    collisions(batch, trained_ids) -> colliding lookups of a held-out batch."""

    def __init__(self, name: str, features: int, dim: int, rows: int, seed: int) -> None:
        self.name, self.features, self.dim, self.rows = name, features, dim, rows
        torch.manual_seed(seed)
        if name == "virtual":
            self.table = VirtualStore(dim, count_spec(rows * features), seed)
        elif name == "hashed":
            self.weight = nn.Parameter(torch.empty(features * rows, dim).uniform_(
                -INIT_BOUND, INIT_BOUND))
        elif name == "mch":
            self.mc_ebc = _mch_ebc(features, dim, rows)
        else:
            raise ValueError(f"unknown config {name!r}")
        self._rows: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None

    def parameters(self) -> list[nn.Parameter]:
        if self.name == "hashed":
            return [self.weight]
        if self.name == "mch":
            return list(self.mc_ebc.parameters())
        return []

    def forward(self, batch, train: bool) -> torch.Tensor:
        kjt = batch.sparse_features
        b = kjt.stride()
        if self.name == "mch":
            self.mc_ebc.train(train)
            kt, _ = self.mc_ebc(kjt)
            names = kjt.keys()
            return torch.cat([kt[k] for k in names], 1)
        keys = fused_keys(kjt.values(), self.features, b)
        if self.name == "hashed":
            slots = (keys >> FEATURE_BITS) * self.rows + (keys & ((1 << FEATURE_BITS) - 1)) \
                % self.rows
            rows = self.weight[slots]
        else:
            rows = self.table.read(keys).requires_grad_(train)
            self._rows, self._keys = rows, keys
        return rows.view(self.features, b, self.dim).permute(1, 0, 2).reshape(b, -1)

    def step(self, lr: float) -> None:
        if self.name == "virtual":
            assert self._rows is not None and self._keys is not None
            self.table.train(self._keys, self._rows.grad, lr)

    def collisions(self, batch, trained: list[dict[int, int]]) -> int:
        kjt = batch.sparse_features
        b = kjt.stride()
        ids = kjt.values().to(torch.int64).view(self.features, b)
        n = 0
        for f in range(self.features):
            if self.name == "hashed":  # trained[f]: slot -> the set of training ids
                n += sum(1 for x in ids[f].tolist()
                         if trained[f].get(x % self.rows, set()) - {x})
            elif self.name == "mch":
                mod = self.mc_ebc._managed_collision_collection._managed_collision_modules[
                    f"t{f}"]
                resident = mod._mch_sorted_raw_ids
                n += int((~torch.isin(ids[f], resident)).sum())
            # virtual: an id reads its own live row or its initial value, never another's
        return n


def _mch_ebc(features: int, dim: int, rows: int) -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    keys = [f"cat_{f}" for f in range(features)]
    tables = [EmbeddingBagConfig(name=f"t{f}", embedding_dim=dim, num_embeddings=rows,
                                 feature_names=[keys[f]], weight_init_min=-INIT_BOUND,
                                 weight_init_max=INIT_BOUND) for f in range(features)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    mcc = ManagedCollisionCollection(
        managed_collision_modules={
            f"t{f}": MCHManagedCollisionModule(
                zch_size=rows, device=torch.device("cpu"),
                eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1,
                input_hash_size=RAW_IDS)
            for f in range(features)},
        embedding_configs=tables)
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False)


def quality_run(name: str, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(held-out AUROC, collision rate) of one config."""
    sizes = [RAW_IDS] * args.features
    train = PowerLawCriteoDataset(sizes, args.batch, args.train_batches, zipf_alpha=1.1,
                                  seed=seed, stream=0)
    test = PowerLawCriteoDataset(sizes, args.batch, args.test_batches, zipf_alpha=1.1,
                                 seed=seed, stream=1)
    emb = Embedder(name, args.features, args.dim, args.bound_rows, seed)
    torch.manual_seed(seed)
    tower = Tower(train.num_dense, args.features, args.dim)
    opt = torch.optim.SGD([{"params": list(tower.parameters())},
                           {"params": emb.parameters(), "lr": args.emb_lr}], lr=args.lr)
    trained: list[dict[int, set[int]]] = [{} for _ in range(args.features)]
    loss_fn = nn.BCEWithLogitsLoss()
    for batch in train:
        opt.zero_grad()
        logits = tower(batch.dense_features, emb.forward(batch, train=True))
        loss_fn(logits, batch.labels).backward()
        opt.step()
        emb.step(args.emb_lr)
        if name == "hashed":
            ids = batch.sparse_features.values().view(args.features, -1)
            for f in range(args.features):
                for x in ids[f].tolist():
                    trained[f].setdefault(x % args.bound_rows, set()).add(x)
    scores, labels, coll, lookups = [], [], 0, 0
    with torch.no_grad():
        for batch in test:
            scores.append(tower(batch.dense_features, emb.forward(batch, train=False)))
            labels.append(batch.labels)
            coll += emb.collisions(batch, trained)
            lookups += batch.sparse_features.values().numel()
    return auroc(torch.cat(scores), torch.cat(labels)), coll / lookups


def part_quality(args: argparse.Namespace) -> None:
    res: dict[str, list[tuple[float, float]]] = {}
    for name in ("hashed", "virtual", "mch"):
        t0 = time.perf_counter()
        res[name] = [quality_run(name, args, seed) for seed in range(args.repeats)]
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    base_auc = median([a for a, _ in res["hashed"]])
    base_coll = median([c for _, c in res["hashed"]])
    for name, runs in res.items():
        auc = median([a for a, _ in runs])
        coll = median([c for _, c in runs])
        common = {"config": name, "baseline_config": "hashed", "rows_per_feature":
                  args.bound_rows, "features": args.features, "raw_ids": RAW_IDS,
                  "train_samples": args.train_batches * args.batch, "repeats": args.repeats}
        emit(metric="auroc", value=auc, unit="", baseline=base_auc, ratio=auc / base_auc,
             **common)
        emit(metric="collision_rate", value=coll, unit="fraction of lookups",
             baseline=base_coll, ratio=coll / base_coll if base_coll else None, **common)


# ---- part 3: store operation rates ---------------------------------------------------------
def store_rates(n: int, dim: int, threads: int, seed: int) -> dict[str, float]:
    """keys/s of insert, find and evict of n distinct raw ids on a fresh store."""
    keys = torch.from_numpy(np.random.default_rng(seed).choice(1 << 40, n, replace=False))
    store = EmbeddingStore(dim=dim, init="uniform", init_bound=INIT_BOUND, seed=seed,
                           key_bound=1 << 40, num_threads=threads)
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    store.lookup(keys, insert_missing=True)
    out["insert"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    store.lookup(keys, insert_missing=False)
    out["find"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    erased = store.erase(keys)
    out["evict"] = n / (time.perf_counter() - t0)
    if erased != n or len(store) != 0:
        raise RuntimeError(f"erase removed {erased} of {n} rows, {len(store)} left")
    return out


def part_store(args: argparse.Namespace) -> None:
    runs = {t: [store_rates(args.store_keys, args.dim, t, seed) for seed in range(args.repeats)]
            for t in (1, 2)}
    for op in ("insert", "find", "evict"):
        base = median([r[op] for r in runs[1]])
        for t in (1, 2):
            val = median([r[op] for r in runs[t]])
            emit(metric="keys_per_s", value=val, unit="keys/s", baseline=base,
                 ratio=val / base, config="virtual", op=op, threads=t, baseline_threads=1,
                 keys=args.store_keys, dim=args.dim)


def part_throughput(args: argparse.Namespace) -> None:
    from dlrm_ranks import run_dlrm  # benchmarks/dlrm_ranks.py (spawns the example's ranks)

    SYNTHETIC_RAW_IDS = (1 << 31) - 1  # examples/dlrm/dlrm_dataloader.py: the raw id space

    world, tables = 2, 26
    common = [
        "--batch_size", str(args.tp_batch), "--limit_train_batches", str(args.tp_steps),
        "--limit_val_batches", "1", "--limit_test_batches", "1", "--embedding_dim", "16",
        "--dense_arch_layer_sizes", "32,16", "--over_arch_layer_sizes", "32,1",
        "--learning_rate", "0.05", "--seed", "1", "--no_progress",
        "--placement-min-rows", "0", "--lookahead", "8",
        "--optimization-cache-capacity", str(args.tp_cache_units),
    ]
    runs: dict[str, list[float]] = {"virtual": [], "virtual_no_eviction": [], "fixed": []}
    accesses: dict[str, float] = {}
    live = 0
    for _ in range(args.repeats):
        for config in runs:
            if config == "virtual":
                # A TTL no row reaches: the rule runs (and counts the live rows) every
                # step, as it does for a table that evicts; nothing is evicted.
                argv = [*common, "--virtual_tables", "--virtual_ttl_steps",
                        str(10 * args.tp_steps)]
            elif config == "virtual_no_eviction":  # no policy: no rule to keep
                argv = [*common, "--virtual_tables"]
            else:  # plain tables over the same raw ids: the same rows live on the PS
                argv = [*common, "--num_embeddings", str(SYNTHETIC_RAW_IDS)]
            r = run_dlrm(argv, world, timeout=args.tp_timeout)[0]
            b = r["bagpipe"]
            if config == "virtual":
                live = int(b["counters"]["live_rows"] // b["ranks"])
            accesses[config] = b.get("accesses", 0.0)
            runs[config].append(r["samples_per_s"] / (world * args.tp_batch))
    if len(set(accesses.values())) != 1:
        raise RuntimeError(f"the configs read different rows: {accesses}")
    f = median(runs["fixed"])
    common_fields = dict(bench="virtual_tables", metric="steps_per_s", unit="steps/s",
                         baseline=f, baseline_config="fixed", live_rows=live,
                         tables=tables, batch=args.tp_batch, world_size=world,
                         steps=args.tp_steps, repeats=args.repeats,
                         cache_rows=64 * args.tp_cache_units)
    for config, values in runs.items():
        v = median(values)
        emit(**common_fields, config=config, value=v, ratio=v / f, runs=values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (a few minutes)")
    p.add_argument("--part", nargs="+", choices=("all", "memory", "quality", "store",
                                                 "throughput"), default=["all"])
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--bound-rows", type=int, default=256,
                   help="rows per feature: the trigger of the virtual table, the size of the "
                        "hashed and MCH tables (default 256: below the data's 1024 ids per "
                        "feature that carry a click effect, so collisions cost quality)")
    p.add_argument("--mem-steps", type=int, default=400)
    p.add_argument("--train-batches", type=int, default=400)
    p.add_argument("--test-batches", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of the MLP")
    p.add_argument("--emb-lr", type=float, default=20.0,
                   help="SGD learning rate of the embeddings (the loss is a batch mean)")
    p.add_argument("--store-keys", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp-steps", type=int, default=60, help="throughput: training batches")
    p.add_argument("--tp-batch", type=int, default=512, help="throughput: batch per rank")
    p.add_argument("--tp-cache-units", type=int, default=256,
                   help="throughput: cache size in units of 64 rows (both configs)")
    p.add_argument("--tp-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.quick:
        args.mem_steps, args.train_batches, args.test_batches = 120, 120, 20
        args.store_keys = 200_000
        args.tp_steps = 30
    torch.set_num_threads(1)
    parts = {"memory", "quality", "store", "throughput"} if "all" in args.part else set(args.part)
    if "memory" in parts:
        part_memory(args)
    if "quality" in parts:
        part_quality(args)
    if "store" in parts:
        part_store(args)
    if "throughput" in parts:
        part_throughput(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
