"""benchmarks/virtual_tables.py at tiny sizes: its AUROC is the pairwise definition
(Hypothesis), its virtual table is the reference rule's (live rows = the dict model's at every
step, bounded by the trigger plus one step's new ids), and its JSON lines carry every config
and store rate."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import virtual_tables as vt  # noqa: E402  (benchmarks/ is not a package)
from traces import make_trace  # noqa: E402

from torchrec_bagpipe.runtime.eviction import EvictionSpec  # noqa: E402
from torchrec_bagpipe.testing.reference_eviction import ReferenceEvictionRule  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=2, max_size=40)
       .filter(lambda xs: len({y for _, y in xs}) == 2))
def test_auroc_is_the_pairwise_probability(samples):
    s = torch.tensor([float(x) for x, _ in samples])
    y = torch.tensor([float(b) for _, b in samples])
    pos = [x for x, b in samples if b]
    neg = [x for x, b in samples if not b]
    want = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert abs(vt.auroc(s, y) - want) < 1e-12


def test_memory_run_follows_the_reference_rule_and_stays_bounded():
    features, batch, steps, dim, bound = 2, 64, 30, 4, 100
    spec = vt.count_spec(bound)
    got = vt.memory_run(spec, steps, batch, features, dim, seed=1)
    unbounded = vt.memory_run(EvictionSpec(), steps, batch, features, dim, seed=1)
    trace = make_trace("drifting", vt.RAW_IDS * features, steps, batch, 1, features=features)
    ref, seen = ReferenceEvictionRule(spec), set()
    for t in range(steps):
        keys = trace[t][0].tolist()
        ref.on_step(t, keys)
        seen.update(keys)
        assert got[t][0] == ref.live  # the store holds exactly the rule's live rows
        assert got[t][0] <= bound + batch * features
        assert unbounded[t][0] == len(seen)  # without a policy every id stays
    assert unbounded[-1][0] > 3 * got[-1][0]
    assert unbounded[-1][1] > got[-1][1]  # bytes follow


def test_quick_lines_carry_every_metric_and_config():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        vt.main(["--quick", "--repeats", "1", "--features", "2", "--batch", "64",
                 "--bound-rows", "64", "--mem-steps", "8", "--train-batches", "6",
                 "--test-batches", "3", "--store-keys", "2000",
                 "--part", "memory", "quality", "store"])
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert all(x["bench"] == "virtual_tables" for x in lines)
    for metric in ("auroc", "collision_rate"):
        got = {x["config"]: x for x in lines if x["metric"] == metric}
        assert set(got) == {"virtual", "hashed", "mch"}
        assert all(x["baseline"] == got["hashed"]["value"] for x in got.values())
    coll = {x["config"]: x["value"] for x in lines if x["metric"] == "collision_rate"}
    assert coll["virtual"] == 0.0 and coll["hashed"] > 0.0 and 0.0 <= coll["mch"] <= 1.0
    aucs = [x["value"] for x in lines if x["metric"] == "auroc"]
    assert all(0.0 <= a <= 1.0 for a in aucs) and np.isfinite(aucs).all()
    live = [x for x in lines if x["metric"] == "live_rows"]
    assert live and all(x["baseline_config"] == "virtual_no_eviction" for x in live)
    rates = {(x["op"], x["threads"]) for x in lines if x["metric"] == "keys_per_s"}
    assert rates == {(op, t) for op in ("insert", "find", "evict") for t in (1, 2)}


@pytest.mark.slow
def test_throughput_lines_compare_virtual_with_fixed_tables():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        vt.main(["--part", "throughput", "--repeats", "1", "--tp-steps", "4",
                 "--tp-batch", "64", "--tp-cache-units", "8"])
    lines = {x["config"]: x for x in map(json.loads, out.getvalue().splitlines())}
    assert set(lines) == {"virtual", "virtual_no_eviction", "fixed"}
    assert all(x["metric"] == "steps_per_s" and x["value"] > 0 for x in lines.values())
    assert lines["virtual"]["baseline"] == lines["fixed"]["value"]
    assert lines["virtual"]["live_rows"] > 0
