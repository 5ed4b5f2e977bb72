"""TorchRec virtual-table configs on BagPipe: policies, placement and bad input.

Unit tests of `distributed/virtual_tables.py` (every TorchRec policy is mapped or refused
naming the table and the policy; placement forces virtual tables onto BagPipe) and, through
DMP on one gloo rank, the id-range checks (a negative id or an id >= num_embeddings is a
ValueError naming the table before anything is written; ids near 2^50 train).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import (
    CountBasedEvictionPolicy,
    CountTimestampMixedEvictionPolicy,
    EmbeddingBagConfig,
    EmbeddingConfig,
    FeatureL2NormBasedEvictionPolicy,
    FeatureScoreBasedEvictionPolicy,
    NoEvictionPolicy,
    TimestampBasedEvictionPolicy,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.placement import decide_placement
from torchrec_bagpipe.distributed.virtual_tables import (
    AdmissionPolicy,
    StepTTLEvictionPolicy,
    eviction_spec_of,
    planned_rows,
)
from torchrec_bagpipe.runtime.eviction import VIRTUAL_AUTO_CACHE_ROWS, EvictionSpec

BIG = 1 << 50


def vt(policy=None, **kw) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name="ids", embedding_dim=4, num_embeddings=kw.pop("n", BIG),
                              feature_names=["f"], use_virtual_table=True,
                              virtual_table_eviction_policy=policy, **kw)


def test_torchrec_policies_map_onto_the_step_rule() -> None:
    assert eviction_spec_of(vt(), 2) == EvictionSpec()
    assert eviction_spec_of(vt(NoEvictionPolicy()), 2) == EvictionSpec()
    assert eviction_spec_of(vt(CountBasedEvictionPolicy(
        eviction_threshold=5, decay_rate=0.9, training_id_eviction_trigger_count=100)), 4) == \
        EvictionSpec(threshold=5.0, decay_rate=0.9, trigger_rows=400)
    assert eviction_spec_of(vt(StepTTLEvictionPolicy(ttl_steps=7)), 2) == \
        EvictionSpec(ttl_steps=7)
    assert eviction_spec_of(vt(StepTTLEvictionPolicy(ttl_steps=7, max_live_rows=50)), 2) == \
        EvictionSpec(ttl_steps=7, max_rows=50)
    with pytest.raises(ValueError, match=r"virtual table 'ids'.*max_live_rows"):
        eviction_spec_of(vt(StepTTLEvictionPolicy(max_live_rows=-1)), 2)
    assert eviction_spec_of(vt(CountTimestampMixedEvictionPolicy(
        eviction_threshold=3, eviction_ttl_mins=0)), 1) == EvictionSpec(threshold=3.0,
                                                                        decay_rate=0.99)
    assert eviction_spec_of(vt(TimestampBasedEvictionPolicy(eviction_ttl_mins=0)), 1) == \
        EvictionSpec()
    # An ordinary table has no rule; a virtual one's cache is sized from a bounded row count.
    plain = EmbeddingConfig(name="p", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    assert eviction_spec_of(plain, 2) is None
    assert planned_rows(vt()) == VIRTUAL_AUTO_CACHE_ROWS and planned_rows(plain) == 10


def test_probabilistic_admission_maps_onto_the_rule_and_bad_values_are_refused() -> None:
    policy = AdmissionPolicy(admit_after=2, eviction=StepTTLEvictionPolicy(ttl_steps=3),
                             admit_probability=0.25, admit_seed=9)
    assert eviction_spec_of(vt(policy), 2) == EvictionSpec(
        ttl_steps=3, admit_after=2, admit_probability=0.25, admit_seed=9)
    for bad in ({"admit_probability": 0.0}, {"admit_probability": 1.5},
                {"admit_seed": -1}, {"admit_seed": 1 << 64}):
        with pytest.raises(ValueError, match=r"virtual table 'ids'.*AdmissionPolicy"):
            eviction_spec_of(vt(AdmissionPolicy(**bad)), 2)


@pytest.mark.parametrize("policy, needle", [
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=60), "TimestampBasedEvictionPolicy"),
    (CountTimestampMixedEvictionPolicy(eviction_ttl_mins=5), "CountTimestampMixed"),
    (FeatureL2NormBasedEvictionPolicy(eviction_threshold=0.1), "FeatureL2NormBased"),
    (FeatureScoreBasedEvictionPolicy(), "FeatureScoreBased"),
])
def test_policies_bagpipe_cannot_honour_are_refused_naming_table_and_policy(policy,
                                                                            needle) -> None:
    with pytest.raises(ValueError, match=rf"virtual table 'ids'.*{needle}"):
        eviction_spec_of(vt(policy), 2)


def test_bad_buckets_and_bad_policy_fields_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'ids'.*total_num_buckets 3 must"):
        eviction_spec_of(vt(total_num_buckets=3, n=10), 1)
    assert eviction_spec_of(vt(total_num_buckets=8), 1) == EvictionSpec()
    with pytest.raises(ValueError, match="decay_rate"):
        eviction_spec_of(vt(CountBasedEvictionPolicy(eviction_threshold=2, decay_rate=2.0)), 1)


def test_placement_puts_virtual_tables_on_bagpipe_and_refuses_stock_constraints() -> None:
    ebc = EmbeddingBagCollection(tables=[vt(), EmbeddingBagConfig(
        name="small", embedding_dim=4, num_embeddings=10, feature_names=["g"])],
        device=torch.device("meta"))
    topo = Topology(world_size=2, compute_device="cpu")
    served = {EmbeddingBagCollection: None}
    out = decide_placement([("ebc", ebc)], served, {}, BagPipeConfig(), topo)
    by = {p.table: p for p in out}
    assert by["ids"].bagpipe and by["ids"].forced and "use_virtual_table" in by["ids"].reason
    stock = {"ids": ParameterConstraints(sharding_types=["table_wise"])}
    with pytest.raises(ValueError, match=r"'ids'.*use_virtual_table=True"):
        decide_placement([("ebc", ebc)], served, stock, BagPipeConfig(), topo)


def _bad_ids(rank: int, world: int) -> list[str]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.distributed import (
        bagpipe_modules,
        bagpipe_plan,
        bagpipe_sharders,
        close_model,
    )

    problems: list[str] = []
    ebc = EmbeddingBagCollection(tables=[vt(StepTTLEvictionPolicy(ttl_steps=1))],
                                 device=torch.device("meta"))
    sharders = bagpipe_sharders(BagPipeConfig(), fused_params={
        "optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=bagpipe_plan(ebc, 1),
                                   sharders=sharders)
    (_, module), = bagpipe_modules(dmp)
    rt = module._bagpipe.runtimes[0]

    def kjt(ids: list[int]):
        return KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.tensor(
            [len(ids)]))

    for ids, needle in (([3, -1], "id -1 outside"), ([BIG], f"id {BIG} outside")):
        try:
            dmp(kjt(ids))
            problems.append(f"ids {ids}: no error")
        except ValueError as e:
            if "'ids'" not in str(e) or needle not in str(e):
                problems.append(f"ids {ids}: unclear error {e}")
    if rt.metrics()["steps"] != 0 or rt.metrics()["committed_step"] != -1:
        problems.append("a refused batch consumed a step")
    # The largest ids train; a row exists on the PS only once trained, and TTL 1 evicts it.
    for ids in ([BIG - 1, 0], [7], [7]):
        out = dmp(kjt(ids))
        out.values().sum().backward()
        dmp.fused_optimizer.step()
    m = rt.metrics()
    if (m["created_rows"], m["evicted_rows"], m["live_rows"]) != (3, 2, 1):
        problems.append(f"rows: {m}")
    close_model(dmp)
    return problems


@pytest.mark.slow
def test_bad_ids_are_refused_naming_the_table_before_anything_is_written() -> None:
    (problems,) = run_world(_bad_ids, 1, timeout=200)
    assert not problems, problems
