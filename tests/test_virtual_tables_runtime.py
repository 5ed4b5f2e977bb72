"""Virtual tables in the runtime: eviction rounds inside the lookahead window.

W simulated ranks train a virtual table whose eviction rule (step TTL, or TorchRec's count
rule with decay, with or without a live-row trigger) evicts rows at step boundaries, while the
caches hold them and the lookahead window prefetches them. The oracle is the plain synchronous
reference applying the same rule (`reference_run_with_state(eviction=)`, whose rule is the
pure-Python `ReferenceEvictionRule`): every row each forward reads is bitwise the reference's
value before the step (an evicted row read later is its initial value: no cache or prefetch
ever serves an evicted row), the final PS rows and optimizer state are bitwise the
reference's, every cached row equals the PS's, and no stale slot is ever found. The PS is the
exact numpy reference or the real PS (PSShard + PSClient over the local transport: evicted
keys ride rank 0's commit, the shards erase them); with the real PS a virtual table starts
empty and an evicted row reads as the store's lazy initial value again.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_ps_backends import TABLE, LocalPSBackend

from torchrec_bagpipe._native import C
from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.ps import EmbeddingStore
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.runtime.eviction import EvictionSpec
from torchrec_bagpipe.testing.reference_eviction import ReferenceEvictionRule
from torchrec_bagpipe.testing.simulate import reference_run_with_state, simulate

DIM = 3
LR = 0.05


class VirtualLocalPS(LocalPSBackend):
    """The real PS holding a virtual table: no rows until trained (no initial assign)."""

    def __init__(self, num_keys, dim, world_size, lr, divide, init, timeout, *,
                 num_shards=2, partitioner="modulo", optimizer="sgd"):
        # LocalPSBackend assigns `init`; a virtual table must start empty, so skip it.
        self.num_keys, self.dim = num_keys, dim
        self.optimizer = OptimizerSpec.of(optimizer)
        from torchrec_bagpipe.ps import Partitioner, PSClient, start_local_shards
        self.shards = start_local_shards(num_shards)
        self.partitioner = Partitioner(partitioner, num_shards)
        self.clients = [
            PSClient(self.shards, table=TABLE, dim=dim, lr=lr, rank=r, world_size=world_size,
                     gradient_division=divide, partitioner=partitioner, timeout=timeout,
                     key_bound=num_keys, optimizer=self.optimizer)
            for r in range(world_size)
        ]

    def live_rows(self) -> int:
        return sum(int(s.table_stats(TABLE)["store"]["rows"]) for s in self.shards)


def store_init(num_keys: int) -> np.ndarray:
    """The lazy initial rows a PS table of `num_keys` keys serves (the clients' defaults)."""
    return EmbeddingStore.initial_rows(torch.arange(num_keys), dim=DIM,
                                       key_bound=num_keys).numpy()


def trace_of(seed: int, world: int, steps: int, universe: int, batch: int):
    rng = np.random.default_rng(seed)
    return [[(np.floor(universe * rng.random(int(rng.integers(0, batch + 1))) ** 2)
              ).astype(np.int64) for _ in range(world)] for _ in range(steps)]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint32),
                                                 np.ascontiguousarray(b).view(np.uint32))


def run(cfg: BagPipeConfig, trace, universe: int, eviction: EvictionSpec, *,
        real_ps: int = 0, optimizer: OptimizerSpec | str = "sgd", submit_ahead: int = 0):
    init = store_init(universe)
    violations: list[str] = []
    lock = threading.Lock()
    box: dict = {}

    def observer(rank, kind, keys, deps, uses, at_step):
        if "ps" in box and kind == "prefetch":
            committed = box["ps"].committed_step()
            if at_step > committed:
                with lock:
                    violations.append(f"prefetch at {at_step} while committed {committed}")

    def step_hook(rank, ctl):
        if ctl._meta is not None and ctl._meta.stats()["stale"] != 0:
            with lock:
                violations.append("a stale slot was found")

    factory = None
    if real_ps:
        def factory(*a, **k):
            box["ps"] = VirtualLocalPS(*a, num_shards=real_ps, **k)
            return box["ps"]
    res = simulate(cfg, trace, num_keys=universe, dim=DIM, lr=LR, init=init,
                   record_reads=True, timeout=30.0, observer=observer, step_hook=step_hook,
                   backend=factory, optimizer=optimizer, eviction=eviction,
                   submit_ahead=submit_ahead)
    assert not violations, violations[:5]
    ref, ref_state = reference_run_with_state(
        trace, init=init, lr=LR, divide=cfg.resolved_gradient_division(), reads=res.reads,
        optimizer=optimizer, eviction=eviction)
    assert same_bits(ref, res.final), "final PS rows != reference"
    assert same_bits(ref_state, res.final_state), "final PS optimizer state != reference"
    ps_rows = np.concatenate([res.final, res.final_state], axis=1)
    for r, (keys, cached) in enumerate(res.cached):
        assert same_bits(cached, ps_rows[keys]), f"rank {r}: cached rows != the PS's"
    rule = ReferenceEvictionRule(eviction)
    for t, per_rank in enumerate(trace):
        ids = dict.fromkeys(int(k) for ks in per_rank for k in ks)
        rule.on_step(t, [k for k in ids if rule.admit(k)])
    for m in res.metrics:
        assert m["stale"] == 0
        assert m["hits"] + m["demand_fetched"] + m["prefetch_served"] == m["accesses"]
        if eviction.tracks:
            assert m["live_rows"] == rule.live and m["evicted_rows"] == rule.evicted
            # fp32 weights and optimizer state of the live rows
            assert m["live_bytes"] == rule.live * 4 * ps_rows.shape[1]
    if real_ps and eviction.tracks:
        assert box["ps"].live_rows() == rule.live, "PS rows != the rule's live rows"
    return res, rule


RULES = [
    EvictionSpec(ttl_steps=1),
    EvictionSpec(ttl_steps=3),
    EvictionSpec(ttl_steps=2, trigger_rows=20),
    EvictionSpec(threshold=1.5, decay_rate=0.9),
    EvictionSpec(threshold=2.0, decay_rate=0.5, trigger_rows=10),
    EvictionSpec(threshold=1.0, decay_rate=0.8, ttl_steps=4),
    EvictionSpec(admit_after=2),
    EvictionSpec(admit_after=3, ttl_steps=2),
    EvictionSpec(admit_after=2, threshold=1.5, decay_rate=0.8, trigger_rows=10),
    EvictionSpec(admit_probability=0.5, admit_seed=11, ttl_steps=3),
    EvictionSpec(max_rows=15),
    EvictionSpec(max_rows=30, threshold=1.0, decay_rate=0.8, trigger_rows=40),
]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), world=st.integers(1, 4), steps=st.integers(1, 14),
       universe=st.sampled_from([20, 60, 200]), batch=st.sampled_from([5, 25, 80]),
       rule=st.sampled_from(RULES), aggregation=st.sampled_from(["ps", "collective"]),
       prescan=st.booleans(), cap=st.sampled_from([1, 2, 16]), lookahead=st.integers(0, 6),
       prepared=st.integers(1, 3), ahead=st.booleans(), real_ps=st.sampled_from([0, 0, 1, 2]),
       optimizer=st.sampled_from(["sgd", "adagrad", "adam"]), read_mode=st.sampled_from(
           ["bagpipe"] * 4 + ["ps"]), submit_ahead=st.integers(0, 1))
def test_eviction_inside_the_window_equals_the_reference(
        seed, world, steps, universe, batch, rule, aggregation, prescan, cap, lookahead,
        prepared, ahead, real_ps, optimizer, read_mode, submit_ahead) -> None:
    cfg = BagPipeConfig(read_mode=read_mode, optimization_prescan=prescan,
                        optimization_cache_capacity=cap, bagpipe_aggregation=aggregation,
                        lookahead=lookahead, prepared_batches=prepared, prepare_ahead=ahead,
                        ps_timeout=30.0)
    run(cfg, trace_of(seed, world, steps, universe, batch), universe, rule, real_ps=real_ps,
        optimizer=optimizer, submit_ahead=submit_ahead)


@pytest.mark.parametrize("aggregation", ["ps", "collective"])
@pytest.mark.parametrize("real_ps", [0, 2])
def test_evicted_rows_come_back_fresh_and_rounds_happen(aggregation, real_ps) -> None:
    """A hot set and a stream of one-off ids: the TTL evicts the one-offs while their copies
    sit in the caches, some return later (recreated from their initial value)."""
    rng = np.random.default_rng(3)
    trace = [[np.concatenate([rng.integers(0, 4, 3), rng.integers(4, 40, 4)]).astype(np.int64)
              for _ in range(2)] for _ in range(30)]
    cfg = BagPipeConfig(optimization_cache_capacity=1, lookahead=4,
                        bagpipe_aggregation=aggregation, ps_timeout=30.0)
    res, rule = run(cfg, trace, 40, EvictionSpec(ttl_steps=2), real_ps=real_ps)
    assert rule.evicted > 20 and rule.created > rule.live + 20
    # Some evicted ids were read again: their reads were checked against fresh rows.
    assert res.metrics[0]["created_rows"] == rule.created


def test_no_eviction_policy_keeps_every_row_and_the_planner_matches_the_rule() -> None:
    trace = trace_of(1, 2, 10, 50, 20)
    _, rule = run(BagPipeConfig(optimization_cache_capacity=1, lookahead=2), trace, 50,
                    EvictionSpec(), real_ps=1)
    assert rule.evicted == 0
    # The native planner with a rule evicts exactly what the reference rule does.
    spec = EvictionSpec(threshold=1.5, decay_rate=0.7)
    planner = C.StepPlanner(2, 0, 2, 50, False, eviction=spec.native())
    ref = ReferenceEvictionRule(spec)
    for t, per_rank in enumerate(trace):
        offsets = np.cumsum([0] + [a.size for a in per_rank])
        planner.add_step(np.concatenate(per_rank), offsets)
        want = ref.on_step(t, (int(k) for a in per_rank for k in a))
        assert planner.plan(t)["evicted"].tolist() == want


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("packet_rows", [2, 4096])
def test_commits_carry_evicted_keys_to_their_shards(shards: int, packet_rows: int) -> None:
    """Evicted keys ride the commit (their own chunks when many: packet_rows 2); each shard
    erases its keys after the step's update and before any read of it; a bad key is a
    ValueError naming `evict` before anything is sent."""
    from torchrec_bagpipe.ps import PSClient, start_local_shards

    n = 1 << 50
    ps = start_local_shards(shards)
    clients = [PSClient(ps, table="t", dim=2, lr=0.5, rank=r, world_size=2,
                        partitioner="hash", key_bound=n, max_packet_rows=packet_rows,
                        timeout=30.0)
               for r in range(2)]
    try:
        keys = torch.tensor([3, 5, n - 1, 2**49, 7, 11, 13], dtype=torch.int64)
        g = torch.ones(keys.numel(), 2)
        for h in [c.commit_async(0, keys, g) for c in clients]:
            h.wait(30)
        init = EmbeddingStore.initial_rows(keys, dim=2, key_bound=n)
        trained = clients[0].lookup(keys)
        assert not torch.equal(trained, init)
        rows = lambda: sum(int(s.table_stats("t")["store"]["rows"]) for s in ps)
        assert rows() == keys.numel()
        with pytest.raises(ValueError, match="evict"):
            clients[0].commit_async(1, keys[:0], torch.zeros(0, 2), evict=torch.tensor([n]))
        gone = keys[[0, 2, 3, 4, 6]]
        h0 = clients[0].commit_async(1, keys[1:2], torch.ones(1, 2), evict=gone)
        h1 = clients[1].commit_async(1, keys[:0], torch.zeros(0, 2))
        h0.wait(30), h1.wait(30)
        assert rows() == keys.numel() - gone.numel()
        got = clients[1].get(keys, 1)
        assert torch.equal(got[[0, 2, 3, 4, 6]], init[[0, 2, 3, 4, 6]])  # fresh again
        assert torch.equal(got[5], trained[5])
        assert not torch.equal(got[1], trained[1])  # step 1 trained it
    finally:
        for c in clients:
            c.close()
        for s in ps:
            s.close()
