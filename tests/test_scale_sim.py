"""benchmarks/scale_sim.py at tiny sizes: its JSON lines parse and carry every series, the
bytes agree with the controllers' counters and the batches (ps: each rank sends its unique
rows' keys and gradients; collective: the all-reduce carries the union of the ranks' rows),
and the TorchRec table-wise / row-wise formulas match a hand-computed case."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import scale_sim  # noqa: E402  (benchmarks/ is not a package)
from traces import make_trace  # noqa: E402


def test_torchrec_bytes_match_a_hand_computed_case() -> None:
    # W = 2 ranks, 2 tables of 4 rows, B = 2 samples, D = 3: fused ids f * 4 + local.
    ranks = [np.array([0, 3, 5, 6]), np.array([1, 2, 7, 4])]
    got = scale_sim.torchrec_bytes(ranks, features=2, rows_per_feature=4, dim=3, batch=2)
    pooled = 2 * 3 * 4  # B x D fp32
    # TW: table 0 on rank 0, table 1 on rank 1; each rank has one remote table of 2 ids:
    # 8 B per id + the pooled outputs back + their gradients: 16 + 2 * 24 = 64 sent per rank.
    tw_sent = 2 * (2 * 8 + 2 * pooled)
    # RW: rows 0-1 of a table on rank 0, 2-3 on rank 1. Rank 0's locals (0, 3) and (1, 2),
    # rank 1's (1, 2) and (3, 0): one remote id per table per rank = 16 B per rank, plus per
    # table a reduce-scatter and an all-gather of (W - 1) x B x D fp32: 2 * 2 * 24 = 96.
    rw_sent = 2 * (2 * 8 + 2 * 2 * (2 - 1) * pooled)
    assert got["tw"] == pytest.approx(2 * tw_sent / 2)  # sent + received, per rank
    assert got["rw"] == pytest.approx(2 * rw_sent / 2)
    assert got == {"tw": 128.0, "rw": 224.0}


def test_fit_exponent_recovers_a_power_law() -> None:
    ws = [2, 8, 32, 128]
    assert scale_sim.fit_exponent(ws, [3.0 * w ** 1.5 for w in ws]) == pytest.approx(1.5)
    assert np.isnan(scale_sim.fit_exponent(ws, [0.0] * 4))


def test_counters_agree_with_the_batches() -> None:
    rows, dim = 2048, 8
    trace = make_trace("zipf1.05", rows, 4, 16, seed=7, world=2, features=4)
    args = argparse.Namespace(rows=rows, cache_pct=5.0, lookahead=2, dim=dim, timeout=120.0)
    unique = np.mean([len(np.unique(x)) for s in trace for x in s])
    union = np.mean([len(np.unique(np.concatenate(s))) for s in trace])
    ps = scale_sim.run_one(trace, args, "ps")
    assert ps["accesses"] == pytest.approx(unique)
    assert ps["gradient_bytes"] == pytest.approx(unique * (8 + 4 * dim))  # keys + fp32 grads
    assert ps["ps_bytes"] == pytest.approx(ps["fetched_bytes"] + ps["gradient_bytes"])
    assert ps["allreduce_bytes"] == 0
    total_fetched = ps["fetched_bytes"] * 2 * 4  # over the 2 ranks and 4 steps: whole rows
    assert total_fetched % (4 * dim) == 0 and ps["fetched_bytes"] <= unique * 4 * dim
    assert ps["metadata_ms"] > 0  # the wrapper saw the native calls
    coll = scale_sim.run_one(trace, args, "collective")
    assert coll["allreduce_bytes"] == pytest.approx(union * 4 * dim)
    assert coll["hit_rate"] >= ps["hit_rate"]  # resident rows stay current everywhere


def test_quick_json_lines_parse_and_cover_every_series(tmp_path: Path) -> None:
    out = io.StringIO()
    argv = ["--quick", "--worlds", "2,3", "--steps", "3", "--batch", "4", "--rows", "1024",
            "--features", "2", "--traces", "zipf1.05,arrival", "--aggregations", "ps,writeback"]
    with contextlib.redirect_stdout(out):
        assert scale_sim.main(argv) == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    for d in lines:
        assert {"bench", "metric", "value", "unit", "baseline", "ratio"} <= d.keys()
        assert d["bench"] == "scale_sim"
    keyed = {(d["trace"], d.get("world_size"), d["metric"]) for d in lines}
    for trace in ("zipf1.05", "arrival"):
        for w in (2, 3):
            for m in ("hit_rate", "served_from_cache", "ps_bytes_per_rank_step",
                      "allreduce_bytes_per_rank_step", "planner_ms_per_step",
                      "metadata_ms_per_step"):
                assert (trace, w, m) in keyed
        assert (trace, None, "scaling_exponent_ps_bytes") in keyed
    for d in lines:
        if d["metric"] == "ps_bytes_per_rank_step":
            assert d["value"] == pytest.approx(d["fetched_bytes"] + d["gradient_bytes"]
                                               + d["write_back_bytes"])
            assert d["ratio"] == pytest.approx(d["value"] / d["torchrec_rw"])


@pytest.mark.parametrize("kind", ["zipf1.05", "drifting", "arrival"])
def test_traces_stay_in_their_features_and_are_deterministic(kind: str) -> None:
    a = make_trace(kind, 1000, 5, 7, seed=3, world=3, features=4, horizon=50)
    b = make_trace(kind, 1000, 5, 7, seed=3, world=3, features=4, horizon=50)
    assert len(a) == 5 and all(len(s) == 3 for s in a)
    for s, t in zip(a, b):
        for x, y in zip(s, t):
            assert np.array_equal(x, y) and x.dtype == np.int64 and x.size == 4 * 7
            for f in range(4):  # feature-major: feature f's ids in its own 250 rows
                assert ((x[f * 7:(f + 1) * 7] // 250) == f).all()
    with pytest.raises(ValueError, match="unknown trace kind"):
        make_trace("uniform", 10, 1, 1, seed=0)
