"""TorchRec virtual tables on BagPipe through DMP (gloo, world size 2) vs the single-process
reference applying the same eviction rule.

The model is an EBC built on `meta` with two virtual tables (ids anywhere in [0, 2^50) and
[0, 2^40): a step TTL and TorchRec's CountBasedEvictionPolicy with decay and a trigger) and an
ordinary BagPipe table. The reference trains the same rows on the concatenated global batch
(mean loss), creates a row from the PS's deterministic initial value when first trained,
and applies `ReferenceEvictionRule` to each virtual table at every step boundary (an evicted
row goes; a later touch starts again from its initial value). Every row any step read, the
live-row counts and the eviction counters must agree.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from _dist import run_world

from torchrec_bagpipe.runtime.eviction import EvictionSpec

pytestmark = pytest.mark.slow

WORLD = 2
DIM = 4
LR = 0.3
BATCH = 3
STEPS = 14
BIG = 1 << 50
MID = 1 << 40
# table -> (num_embeddings, feature, the policy's EvictionSpec as BagPipe reads it for W=2)
TABLES = {"v": (BIG, "fv"), "c": (MID, "fc"), "o": (30, "fo")}
RULES = {"v": EvictionSpec(ttl_steps=2),
         "c": EvictionSpec(threshold=1.5, decay_rate=0.8, trigger_rows=3 * WORLD)}
# The admission variant: table "v" trains an id only from its second step.
ADMIT_RULES = {**RULES, "v": EvictionSpec(ttl_steps=2, admit_after=2)}
# Probabilistic admission and the live-row cap on top.
COIN_RULES = {**RULES, "v": EvictionSpec(ttl_steps=2, admit_after=2, admit_probability=0.6,
                                         admit_seed=5, max_rows=4)}


def _ids(t: int, r: int, table: str) -> list[list[int]]:
    """Per sample, its ids: a few hot ids and a stream of new ones (large, scattered)."""
    g = torch.Generator().manual_seed(1000 * t + 10 * r + ord(table))
    n, _ = TABLES[table]
    out = []
    for _ in range(BATCH):
        k = int(torch.randint(0, 3, (1,), generator=g))
        xs = torch.randint(0, 12, (k,), generator=g).tolist()
        if table == "o":
            out.append([x % n for x in xs])
        else:
            out.append([(x * 0x9E3779B97F4A7C15 + (t % 5)) % n for x in xs])
    return out


def _kjt(t: int, r: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, values, lengths = [], [], []
    for table, (_, feat) in TABLES.items():
        keys.append(feat)
        for ids in _ids(t, r, table):
            values.extend(ids)
            lengths.append(len(ids))
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64))


def _configs(kind: str = "ebc", admit: bool | str = False):
    from torchrec.modules.embedding_configs import (
        CountBasedEvictionPolicy,
        EmbeddingBagConfig,
        EmbeddingConfig,
    )

    from torchrec_bagpipe.distributed import AdmissionPolicy, StepTTLEvictionPolicy

    v_policy = StepTTLEvictionPolicy(ttl_steps=2)
    if admit == "coin":
        v_policy = AdmissionPolicy(
            admit_after=2, eviction=StepTTLEvictionPolicy(ttl_steps=2, max_live_rows=4),
            admit_probability=0.6, admit_seed=5)
    elif admit:
        v_policy = AdmissionPolicy(admit_after=2, eviction=v_policy)
    Config = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    return [
        Config(name="v", embedding_dim=DIM, num_embeddings=BIG, feature_names=["fv"],
                           use_virtual_table=True, total_num_buckets=4,
                           weight_init_min=-0.5, weight_init_max=0.5,
                           virtual_table_eviction_policy=v_policy),
        Config(name="c", embedding_dim=DIM, num_embeddings=MID, feature_names=["fc"],
                           use_virtual_table=True, weight_init_min=-0.5, weight_init_max=0.5,
                           virtual_table_eviction_policy=CountBasedEvictionPolicy(
                               eviction_threshold=1.5, decay_rate=0.8,
                               training_id_eviction_trigger_count=3)),
        Config(name="o", embedding_dim=DIM, num_embeddings=30, feature_names=["fo"]),
    ]


def _loss(values: torch.Tensor) -> torch.Tensor:
    return ((values - 0.1) ** 2).sum() / values.shape[0]


def _forward_loss(dmp, kjt, kind: str) -> torch.Tensor:
    out = dmp(kjt)
    if kind == "ebc":
        return _loss(out.values())
    # EC: one row per id; the loss of each sample's ids, per feature in table order.
    return sum(((out[feat].values() - 0.1) ** 2).sum() for _, feat in TABLES.values()
               ) / BATCH


def _train(rank: int, world: int, cfg_fields: dict, kind: str = "ebc",
           admit: bool | str = False) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import (
        BagPipeShardingPlanner,
        bagpipe_metrics,
        bagpipe_modules,
        bagpipe_sharders,
        close_model,
    )

    torch.manual_seed(0)
    if kind == "ebc":
        ebc = EmbeddingBagCollection(tables=_configs("ebc", admit), device=torch.device("meta"))
    else:
        ebc = EmbeddingCollection(tables=_configs("ec", admit), device=torch.device("meta"))
    config = BagPipeConfig(placement_min_rows=0, **cfg_fields)
    sharders = bagpipe_sharders(config, fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                      "learning_rate": LR})
    planner = BagPipeShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                     batch_size=BATCH)
    plan = planner.collective_plan(ebc, sharders)
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=sharders)
    for t in range(STEPS):
        _forward_loss(dmp, _kjt(t, rank), kind).backward()
        dmp.fused_optimizer.step()
    (_, module), = bagpipe_modules(dmp)
    tables = module._bagpipe
    seen: dict[str, set[int]] = {name: set() for name in TABLES}
    for t in range(STEPS):
        for q in range(world):
            for name in TABLES:
                for ids in _ids(t, q, name):
                    seen[name].update(ids)
    rows = {}
    layout = tables.layout
    for name in TABLES:
        keys = sorted(seen[name])
        g = layout.group_of(name)
        fused = torch.tensor(keys, dtype=torch.int64) + layout.fused_start(name)
        uniq, inv = tables.runtimes[g].eval_rows(fused)
        rows[name] = (keys, uniq[inv].tolist())  # plain lists cross the queue
    metrics = {name: {k: v for k, v in tables.runtimes[layout.group_of(name)].metrics().items()
                      if k in ("live_rows", "created_rows", "evicted_rows", "stale")}
               for name in RULES}
    metrics["all"] = bagpipe_metrics(dmp)
    state_keys = sorted(dmp.state_dict())
    close_model(dmp)
    return {"rows": rows, "metrics": metrics, "state_keys": state_keys}


def _reference(kind: str = "ebc", admit: bool | str = False
               ) -> tuple[dict[str, dict[int, torch.Tensor]], dict]:
    from torchrec_bagpipe.ps import EmbeddingStore
    from torchrec_bagpipe.testing.reference_eviction import ReferenceEvictionRule

    def init_row(name: str, k: int) -> torch.Tensor:
        n, _ = TABLES[name]
        bound = 0.5 if name != "o" else (1.0 / n) ** 0.5
        return EmbeddingStore.initial_rows(torch.tensor([k]), dim=DIM, init_bound=[(0, bound)],
                                           key_bound=n)[0]

    live: dict[str, dict[int, torch.Tensor]] = {name: {} for name in TABLES}
    refusals = 0
    specs = COIN_RULES if admit == "coin" else ADMIT_RULES if admit else RULES
    rules = {name: ReferenceEvictionRule(specs[name]) for name in specs}
    for t in range(STEPS):
        per_sample = []  # global batch: rank 0's samples, then rank 1's
        for q in range(WORLD):
            for b in range(BATCH):
                per_sample.append({name: _ids(t, q, name)[b] for name in TABLES})
        params: dict[str, dict[int, torch.Tensor]] = {name: {} for name in TABLES}
        refused: dict[str, set[int]] = {name: set() for name in TABLES}
        for s in per_sample:
            for name, ids in s.items():
                for k in ids:
                    if k in params[name]:
                        continue
                    if name in rules and not rules[name].admit(k):
                        # Not admitted at this step: reads zeros, no gradient.
                        params[name][k] = torch.zeros(DIM)
                        refused[name].add(k)
                        refusals += 1
                        continue
                    if k not in params[name]:
                        base = live[name].get(k)
                        base = init_row(name, k) if base is None else base
                        params[name][k] = base.clone().requires_grad_(True)
        if kind == "ebc":
            outs = []
            for s in per_sample:
                outs.append(torch.cat([
                    torch.stack([params[name][k] for k in s[name]]).sum(0) if s[name]
                    else torch.zeros(DIM) for name in TABLES]))
            _loss(torch.stack(outs)).backward()
        else:
            loss = sum(((params[name][k] - 0.1) ** 2).sum() for s in per_sample
                       for name in TABLES for k in s[name])
            (loss / len(per_sample)).backward()
        with torch.no_grad():
            for name in TABLES:
                for k, p in params[name].items():
                    if k not in refused[name]:
                        live[name][k] = (p - LR * p.grad).detach()
        for name, rule in rules.items():
            trained = [k for k in params[name] if k not in refused[name]]
            for k in rule.on_step(t, trained):
                del live[name][k]
    stats = {name: (rule.live, rule.created, rule.evicted) for name, rule in rules.items()}
    if admit and refusals == 0:
        raise AssertionError("the admission reference refused no id (a weak test)")
    return live, stats


def _check(results: list[dict], kind: str = "ebc", admit: bool | str = False) -> list[str]:
    from torchrec_bagpipe.ps import EmbeddingStore

    problems = []
    live, stats = _reference(kind, admit)
    got = results[0]
    for name, (keys, rows) in got["rows"].items():
        n, _ = TABLES[name]
        bound = 0.5 if name != "o" else (1.0 / n) ** 0.5
        for i, k in enumerate(keys):
            want = live[name].get(k)
            if want is None:  # evicted (or never trained): reads as its initial value
                want = EmbeddingStore.initial_rows(torch.tensor([k]), dim=DIM,
                                                   init_bound=[(0, bound)], key_bound=n)[0]
            if not torch.allclose(torch.tensor(rows[i]), want, rtol=1e-5, atol=1e-6):
                problems.append(f"table {name} id {k}: {rows[i]} != {want.tolist()}")
    for name, (n_live, created, evicted) in stats.items():
        m = got["metrics"][name]
        want = {"live_rows": n_live, "created_rows": created, "evicted_rows": evicted,
                "stale": 0}
        if m != want:
            problems.append(f"table {name}: metrics {m} != the reference rule's {want}")
        if evicted == 0:
            problems.append(f"table {name}: the reference evicted nothing (a weak test)")
    if any(".v." in k or ".c." in k for k in got["state_keys"]):
        problems.append(f"virtual tables in the state dict: {got['state_keys']}")
    return problems


def test_virtual_tables_in_an_embedding_collection_equal_the_reference() -> None:
    fields = {"bagpipe_aggregation": "ps", "lookahead": 2,
              "optimization_cache_capacity": 1}
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_train, WORLD, args=(fields, "ec"), env={"BAGPIPE_TEST_TMP": tmp},
                            timeout=300)
    problems = _check(results, "ec")
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize(("kind", "admit"), [("ebc", True), ("ec", True), ("ebc", "coin")])
def test_admission_reads_zeros_until_admitted_and_equals_the_reference(kind, admit) -> None:
    fields = {"bagpipe_aggregation": "collective" if kind == "ebc" else "ps", "lookahead": 2,
              "optimization_cache_capacity": 1}
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_train, WORLD, args=(fields, kind, admit),
                            env={"BAGPIPE_TEST_TMP": tmp}, timeout=300)
    problems = _check(results, kind, admit=admit)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("fields", [
    {"bagpipe_aggregation": "ps", "optimization_cache_capacity": 1, "lookahead": 3},
    {"bagpipe_aggregation": "collective", "optimization_prescan": False, "lookahead": 2},
], ids=["ps", "collective"])
def test_virtual_tables_equal_the_single_process_reference(fields) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(_train, WORLD, args=(fields,), env={"BAGPIPE_TEST_TMP": tmp},
                            timeout=300)
    problems = _check(results)
    assert not problems, "\n".join(problems[:20])
