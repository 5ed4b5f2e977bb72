"""The cache-policy benchmark's baselines: Belady's MIN and the reuse horizon (issue 26.3).

The gap-to-MIN table (benchmarks/cache_policy.py, docs/adaptive_lookahead.md) is only as good
as its MIN and its needed-window measure, so both are checked here against brute-force
definitions over random traces."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import cache_policy as cp  # noqa: E402  (needs benchmarks/ on sys.path)

traces = st.lists(
    st.lists(st.integers(0, 30), min_size=1, max_size=12), min_size=1, max_size=14
).map(lambda steps: [[np.array(s, dtype=np.int64)] for s in steps])


def _brute_min(trace: list[list[np.ndarray]], capacity: int) -> tuple[int, int]:
    """MIN with bypass, one row at a time: keep the `capacity` soonest next uses."""
    steps = [sorted(set(int(k) for k in per[0])) for per in trace]
    resident: set[int] = set()
    hits = accesses = 0
    for t, keys in enumerate(steps):
        accesses += len(keys)
        hits += sum(k in resident for k in keys)
        cand = resident | set(keys)

        def nxt(k: int, t: int = t) -> int:
            for s in range(t + 1, len(steps)):
                if k in steps[s]:
                    return s
            return 1 << 60

        ranked = sorted((nxt(k), k) for k in cand if nxt(k) < 1 << 60)
        resident = {k for _, k in ranked[:capacity]}
    return hits, accesses


@settings(max_examples=60, deadline=None)
@given(traces, st.integers(1, 12))
def test_belady_min_matches_brute_force_and_capacity(trace, capacity):
    hits, acc, kept = cp.belady_min(trace, capacity, keep_sets=True)
    bh, ba = _brute_min(trace, capacity)
    assert (hits, acc) == (bh, ba)
    steps = [np.unique(per[0]) for per in trace]
    for t, k in enumerate(kept):
        assert k.size <= capacity  # capacity respected after every step
        # kept rows are ones MIN had (resident or just read): never a row from nowhere
        seen = np.unique(np.concatenate(steps[: t + 1]))
        assert np.isin(k, seen).all()
    # hits are exactly the next step's reads found in the kept set
    recount = sum(int(np.isin(steps[t + 1], kept[t]).sum()) for t in range(len(steps) - 1))
    assert recount == hits


@settings(max_examples=60, deadline=None)
@given(traces, st.integers(1, 12), st.integers(1, 16))
def test_reuse_horizon_is_smallest_window_covering_capacity_reuses(trace, capacity, hi):
    _, _, kept = cp.belady_min(trace, capacity, keep_sets=True)
    need = cp.reuse_horizons(trace, capacity, hi)
    steps = [set(int(k) for k in np.unique(per[0])) for per in trace]
    for t in range(len(steps)):
        cand = set(kept[t].tolist())
        goal = min(capacity, len(cand))

        def covered(w: int, t: int = t, cand: set[int] = cand) -> int:
            return len(cand & set().union(*steps[t + 1 : t + 1 + w])) if w else 0

        limit = min(hi, len(steps) - 1 - t)
        w = need[t]
        assert 0 <= w <= limit
        if w < limit:
            assert covered(w) >= goal  # stopped early: the window covers the goal ...
        assert w == 0 or covered(w - 1) < goal  # ... and no shorter window does


def test_hit_rate_part_reports_the_adaptive_window_against_the_best_fixed_one(capsys):
    """The adaptive lines (issue 26 item 3): one per lookahead below the bound, baseline the
    best fixed window's hit rate in the same run, with the window it ran at."""
    import argparse
    import json

    args = argparse.Namespace(rows=2_000, steps=20, batch=256, lookaheads=[2, 8],
                              lookahead_max=8, traces=["zipf1.05"], pcts=[5.0], dim=4)
    cp.part_hit_rate(args)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    best = next(d for d in lines if d["metric"] == "best_fixed_gap_to_min")
    fixed = {d["lookahead"]: d for d in lines if d["metric"] == "gap_to_min"}
    ada = [d for d in lines if d["metric"] == "adaptive_gap_to_min"]
    assert [d["lookahead"] for d in ada] == [2]  # lookahead 8 is the bound itself
    d = ada[0]
    assert d["lookahead_max"] == 8 and 2 <= d["window_mean"] <= 8
    min_rate = d["min_hit_rate"]
    best_rate = min_rate - best["value"]
    assert d["baseline"] == pytest.approx(best_rate)
    assert best_rate == pytest.approx(min_rate - fixed[best["lookahead"]]["value"])
    assert d["ratio"] == pytest.approx((min_rate - d["value"]) / best_rate)
