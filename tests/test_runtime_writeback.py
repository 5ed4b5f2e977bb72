"""Write-back aggregation (issue 26 item 1): the caches own their resident rows.

The Hypothesis suites of tests/test_runtime_controller.py draw `writeback` among the
aggregations (every read fresh, final rows and optimizer state bitwise the single-process
reference, every cached row the PS's after the flush, prescan = online, prepared ahead or
not); here: what only this mode does, measured on its counters, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from test_runtime_controller import DIM, LR, OPTIMIZERS, make_trace, run_checked

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.runtime.collectives import ThreadGroup
from torchrec_bagpipe.runtime.controller import BagPipeController
from torchrec_bagpipe.runtime.eviction import EvictionSpec
from torchrec_bagpipe.testing.reference_ps import ReferencePS
from torchrec_bagpipe.testing.simulate import reference_run_with_state, simulate

WB = BagPipeConfig(bagpipe_aggregation="writeback", lookahead=3, ps_timeout=30.0)


@pytest.mark.parametrize("backend", [("reference", 0.001), ("local", 2, "hash")],
                         ids=["reference_ps", "real_ps"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_cache_holding_every_row_sends_no_gradient_and_writes_everything_back_once(
    name: str, backend
) -> None:
    trace = make_trace(3, 2, 16, 60, 40, 2.0)  # 60 rows: one 64-row unit holds them all
    seen: list[int] = []
    res = run_checked(WB.replace(optimization_cache_capacity=1), trace, 60, backend,
                      OPTIMIZERS[name], LR)
    for m in res.metrics:
        assert m["gradient_payload_bytes"] == 0  # no row ever left the caches
        assert m["evictions"] == 0 and m["written_back_rows"] == 0 and m["local_updates"] > 0
        seen.append(int(m["flushed_rows"]))
    # The final flush wrote every resident row back, from every rank (all the same values).
    touched = np.unique(np.concatenate([k for per in trace for k in per])).size
    assert seen == [touched, touched]


def test_evicted_rows_go_back_to_the_ps_before_anyone_reads_them_again() -> None:
    trace = make_trace(8, 2, 30, 400, 90, 1.5)  # 90 ids > a one-unit (64-row) cache
    res = run_checked(WB.replace(optimization_cache_capacity=1), trace, 400,
                      ("local", 2, "modulo"), OPTIMIZERS["adagrad"], LR)
    ms = res.metrics
    assert ms[0]["evictions"] > 0 and ms[0]["evictions"] == ms[1]["evictions"]  # replicated
    # Each eviction is written back by one rank (its key's designated one); the final flush
    # writes every resident row from every rank.
    assert sum(m["written_back_rows"] for m in ms) == ms[0]["evictions"]
    assert all(m["flushed_rows"] == ms[0]["resident_rows"] for m in ms)
    assert all(m["gradient_payload_bytes"] > 0 for m in ms)  # bypassed rows still commit


def test_drain_between_steps_makes_the_ps_the_synchronous_model() -> None:
    """A drain (state dicts, DCP, eval reads) writes the caches' rows back: the PS then holds
    the reference values after the last finished step."""
    trace = make_trace(5, 2, 12, 150, 60, 2.0)
    init = np.random.default_rng(5).uniform(-1, 1, (150, DIM)).astype(np.float32)
    got: dict[int, np.ndarray] = {}
    box: dict = {}

    def hook(rank: int, ctl: BagPipeController) -> None:
        t = ctl.metrics()["steps"] - 1
        ctl.drain()
        if rank == 0 and t in (3, 7):
            got[t] = box["ps"].snapshot()

    orig = ReferencePS.__init__

    def capture(self, *a, **k):
        orig(self, *a, **k)
        box["ps"] = self

    from unittest import mock

    with mock.patch.object(ReferencePS, "__init__", capture):
        simulate(WB.replace(optimization_cache_capacity=2), trace, num_keys=150, dim=DIM,
                 lr=LR, init=init, step_hook=hook, timeout=30.0)
    for t, snap in got.items():
        want, _ = reference_run_with_state(trace[: t + 1], init=init, lr=LR, divide=True)
        assert np.array_equal(snap.view(np.uint32), want.view(np.uint32)), t


def test_writeback_needs_a_cache_and_refuses_virtual_tables() -> None:
    with pytest.raises(ValueError, match="'writeback' needs read_mode 'bagpipe'"):
        BagPipeConfig(bagpipe_aggregation="writeback", read_mode="ps")
    ps = ReferencePS(10, DIM, 1, LR)
    with pytest.raises(ValueError, match="does not run virtual tables"):
        BagPipeController(WB, rank=0, world_size=1, dim=DIM, num_keys=10, lr=LR,
                          ps=ps.client(0), collectives=ThreadGroup(1).collectives(0),
                          eviction=EvictionSpec(ttl_steps=2))


def test_write_back_log_of_a_large_table_forgets_committed_steps() -> None:
    """Beyond 2^24 rows the log is a map; steps the PS committed leave it (a get served after
    them reads their write-backs anyway), so it stays about the size of the recent
    evictions, and the dependencies it raises are the array's."""
    from torchrec_bagpipe.runtime.writeback_aggregation import WriteBackLog

    committed = [-1]
    big = WriteBackLog(1 << 40, rank=0, world_size=2, committed=lambda: committed[0])
    small = WriteBackLog(1 << 20, rank=0, world_size=2, committed=lambda: committed[0])
    rng = np.random.default_rng(0)
    none = np.zeros(0, dtype=np.int64)
    for t in range(40):
        keys = np.unique(rng.integers(0, 1 << 20, 5000))
        for log in (big, small):
            log.evicted(t, keys, none, none)
        committed[0] = t - 2  # the PS two steps behind
        probe = rng.integers(0, 1 << 20, 1000)
        deps = rng.integers(-1, t + 1, 1000)
        want = small.deps(probe, deps)
        got = big.deps(probe, deps)
        # The same wherever it matters: above the committed step.
        assert np.array_equal(np.maximum(got, committed[0]), np.maximum(want, committed[0]))
    assert len(big._sparse) < 4 * 5000 * 4  # a few steps' evictions, not all 40 steps'
