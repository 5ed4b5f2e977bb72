"""Planners: prescan and online yield identical plans; plans match the definitions; errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_bagpipe.runtime.access_plans import (
    OnlinePlanner,
    PlanMismatchError,
    PrescanPlanner,
)


@st.composite
def traces(draw):
    world = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 12))
    universe = draw(st.integers(2, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    perm = rng.permutation(universe)  # hot ids scattered over the key space
    trace = []
    for _ in range(steps):
        per_rank = []
        for _ in range(world):
            n = int(rng.integers(0, 12))
            ranks = np.floor(universe * rng.random(n) ** 2.5).astype(np.int64)
            per_rank.append(perm[ranks].astype(np.int64))
        trace.append(per_rank)
    return world, universe, trace


def brute_force(trace, rank: int, lookahead: int, collective: bool):
    """The plan definitions of csrc/cache/step_planner.h, computed the slow way."""
    T = len(trace)
    W = len(trace[0])

    def by(s, q, k):
        return k in set(trace[s][q].tolist())

    def others(s, k):
        return any(by(s, q, k) for q in range(W) if q != rank)

    def survives(k, a, b):
        return collective or not any(others(s, k) for s in range(a, b))

    out = []
    for t in range(T):
        batch = trace[t][rank].tolist()
        uniq = list(dict.fromkeys(batch))
        dep, nxt, prv, shared = [], [], [], []
        for k in uniq:
            d = next((s for s in range(t - 1, -1, -1) if any(by(s, q, k) for q in range(W))), -1)
            dep.append(d)
            shared.append(others(t, k))
            u = next((u for u in range(t + 1, min(T, t + lookahead + 1)) if by(u, rank, k)), -1)
            nxt.append(u if u >= 0 and survives(k, t, u) else -1)
            p = next((s for s in range(t - 1, -1, -1) if by(s, rank, k)), -1)
            prv.append(p if p >= 0 and survives(k, p, t) else -1)
        # ps: keys another rank touches at t whose copy from this rank's previous read p < t
        # is still valid (nobody else touched them in [p, t)), in union order.
        union = list(dict.fromkeys(k for q in range(W) for k in trace[t][q].tolist()))
        inval = []
        if not collective:
            for k in union:
                p = next((s for s in range(t - 1, -1, -1) if by(s, rank, k)), -1)
                if others(t, k) and p >= 0 and survives(k, p, t):
                    inval.append(k)
        out.append(dict(unique=uniq, dep=dep, next_use=nxt, prev_use=prv, shared=shared,
                        others=inval))
    return out


@settings(max_examples=60, deadline=None)
@given(traces(), st.integers(0, 5), st.booleans(), st.data())
def test_prescan_and_online_plans_are_identical_and_match_definitions(
    tr, lookahead: int, collective: bool, data
) -> None:
    world, universe, trace = tr
    rank = data.draw(st.integers(0, world - 1))
    kw = dict(world_size=world, rank=rank, lookahead=lookahead, num_keys=universe,
              collective=collective)
    pre = PrescanPlanner(**kw)
    pre.build(trace, progress=False, chunk_steps=data.draw(st.integers(1, 5)))
    onl = OnlinePlanner(**kw)
    for per_rank in trace:
        onl.add_step(per_rank)
    want = brute_force(trace, rank, lookahead, collective)
    for t in range(len(trace)):
        a, b = pre.plan(t), onl.plan(t)
        for field in ("unique_keys", "inverse", "deps", "next_use", "prev_use", "shared",
                      "others", "union_keys", "union_pos", "s_now"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), (t, field)
        assert a.unique_keys.tolist() == want[t]["unique"]
        assert a.deps.tolist() == want[t]["dep"]
        assert a.next_use.tolist() == want[t]["next_use"]
        assert a.prev_use.tolist() == want[t]["prev_use"]
        assert a.shared.tolist() == want[t]["shared"]
        assert a.others.tolist() == want[t]["others"]
        assert np.array_equal(a.unique_keys[a.inverse], trace[t][rank])
        assert np.array_equal(a.keep, a.next_use >= 0)
        assert a.global_ids == sum(k.size for k in trace[t])
    assert pre.memory_bytes() > 0


def test_prescan_check_names_step_and_rank() -> None:
    trace = [[np.array([1, 2], dtype=np.int64), np.array([3], dtype=np.int64)]] * 3
    pre = PrescanPlanner(world_size=2, rank=1, lookahead=2, num_keys=10, collective=False)
    pre.build(trace, progress=True)
    assert pre.startup_seconds > 0
    pre.check(0, np.array([3], dtype=np.int64))
    with pytest.raises(PlanMismatchError, match=r"step 2 on rank 1: position 0: id 4"):
        pre.check(2, np.array([4], dtype=np.int64))
    with pytest.raises(PlanMismatchError, match=r"step 1 on rank 1: 2 ids submitted, 1 planned"):
        pre.check(1, np.array([3, 3], dtype=np.int64))
    with pytest.raises(PlanMismatchError, match=r"step 3 on rank 1: .* only 3 steps"):
        pre.check(3, np.array([3], dtype=np.int64))


def test_planner_input_errors() -> None:
    onl = OnlinePlanner(world_size=2, rank=0, lookahead=1, num_keys=10, collective=False)
    with pytest.raises(ValueError, match=r"step 0, rank 1: key 10 at position 1 is outside"):
        onl.add_step([np.array([1], dtype=np.int64), np.array([2, 10], dtype=np.int64)])
    assert onl.num_steps == 0
    with pytest.raises(TypeError, match="keys of rank 0 must have dtype int64"):
        onl.add_step([np.array([1], dtype=np.int32), np.array([2], dtype=np.int64)])
    with pytest.raises(ValueError, match="expected 2 ranks"):
        onl.add_step([np.array([1], dtype=np.int64)])
    pre = PrescanPlanner(world_size=1, rank=0, lookahead=1, num_keys=10, collective=False)
    with pytest.raises(ValueError, match="step 0 has 2 ranks"):
        pre.build([[np.array([1]), np.array([1])]], progress=False)
    with pytest.raises(ValueError, match="rank must lie"):
        OnlinePlanner(world_size=2, rank=2, lookahead=1, num_keys=10, collective=False)


@settings(max_examples=60, deadline=None)
@given(traces(), st.integers(0, 5), st.data())
def test_replicated_plans_are_the_unions_on_every_rank(tr, lookahead: int, data) -> None:
    """Write-back aggregation (step_planner.h invariant 10): each rank's plan is that of one
    rank reading every rank's keys (a world of one fed the concatenation, in rank order),
    with its own batch mapped into the union; prescan and online agree."""
    world, universe, trace = tr
    rank = data.draw(st.integers(0, world - 1))
    kw = dict(world_size=world, rank=rank, lookahead=lookahead, num_keys=universe,
              collective=True, replicated=True)
    online = OnlinePlanner(**kw)
    prescan = PrescanPlanner(**kw)
    prescan.build(trace, progress=False)
    one = OnlinePlanner(world_size=1, rank=0, lookahead=lookahead, num_keys=universe,
                        collective=True)
    for per_rank in trace:
        online.add_step(per_rank)
        one.add_step([np.concatenate(per_rank)])
    for t in range(len(trace)):
        a, b, want = online.plan(t), prescan.plan(t), one.plan(t)
        for p in (a, b):
            assert np.array_equal(p.unique_keys, want.unique_keys)
            assert np.array_equal(p.unique_keys, p.union_keys)
            assert np.array_equal(p.union_pos, np.arange(p.unique_keys.size))
            for f in ("deps", "next_use", "prev_use", "s_now"):
                assert np.array_equal(getattr(p, f), getattr(want, f)), f
            assert not p.shared.any() and p.others.size == 0
            assert np.array_equal(p.unique_keys[p.inverse], trace[t][rank])
            # The rank's own unique keys, first-occurrence order, and its batch over them.
            own = np.array(list(dict.fromkeys(trace[t][rank].tolist())), dtype=np.int64)
            assert np.array_equal(p.unique_keys[p.own_pos], own)
            assert np.array_equal(own[p.own_inverse], trace[t][rank])
    assert one.plan(0).own_pos.size == 0 and one.plan(0).own_inverse.size == 0


def test_replicated_planner_needs_collective_and_no_eviction_rule() -> None:
    with pytest.raises(ValueError, match="replicated planner needs collective"):
        OnlinePlanner(world_size=2, rank=0, lookahead=2, num_keys=10, collective=False,
                      replicated=True)
