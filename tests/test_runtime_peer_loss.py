"""A peer rank lost during the online ID exchange: the survivor's error says which rank, which
step and what it awaited (it used to be a bare TimeoutError with an empty message).

The fast tests inject a collective that never answers (a peer that died or hung without the
process group noticing); the slow one runs two gloo ranks and lets one exit mid-run.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.runtime.controller import BagPipeController, ControllerError
from torchrec_bagpipe.testing.reference_ps import ReferencePS

DIM = 3
LR = 0.05


class NeverAnswers:
    """`Collectives` of rank `rank` of `world_size` whose peers never take part: every call
    blocks until `release()` (so the test can end the worker thread)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.calls = 0
        self._released = threading.Event()

    def _block(self) -> None:
        self.calls += 1
        self._released.wait(60)
        raise RuntimeError("released by the test")

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._block()
        return []

    def all_reduce_sum_(self, t: torch.Tensor) -> None:
        self._block()

    def barrier(self) -> None:
        self._block()

    def release(self) -> None:
        self._released.set()


def _controller(world: int, rank: int = 0, **cfg):
    coll = NeverAnswers(rank, world)
    ps = ReferencePS(20, DIM, world, LR, timeout=5.0)
    config = BagPipeConfig(optimization_cache_capacity=1, lookahead=1, ps_timeout=0.3, **cfg)
    ctl = BagPipeController(config, rank=rank, world_size=world, dim=DIM, num_keys=20, lr=LR,
                            ps=ps.client(rank), collectives=coll)
    return ctl, coll


@pytest.mark.parametrize("world, rank, awaited, culprit", [
    (2, 0, r"rank 1", r"rank 1 died"),
    (2, 1, r"rank 0", r"rank 0 died"),
    (4, 2, r"ranks \[0, 1, 3\]", r"one of them died"),
])
def test_a_silent_peer_is_named_with_the_step_and_the_exchange(world, rank, awaited, culprit):
    ctl, coll = _controller(world, rank)
    try:
        ctl.submit(torch.tensor([1, 2]))
        ctl.submit(torch.tensor([2, 3]))
        with pytest.raises(TimeoutError) as e:
            ctl.next_step()
        text = str(e.value)
        assert text, "a bare TimeoutError"
        pattern = (rf"rank {rank} of {world}: the online ID exchange of step 0 \(an all_gather "
                   rf"of every rank's keys of batch 0\) did not complete within 0\.3 s: it "
                   rf"awaits {awaited} \(in the collective\); {culprit}, hung or stopped "
                   r"submitting batches")
        assert e.match(pattern), text
        assert coll.calls == 1  # the exchange of step 1 is still queued behind it
        with pytest.raises(ControllerError, match="failed earlier"):
            ctl.next_step()
    finally:
        coll.release()
        ctl.close(close_ps=False)


def test_an_exchange_queued_behind_a_stuck_collective_says_so():
    """A step whose preparation waits for the exchange of a later batch (lookahead) that is
    still queued behind the stuck one names that step and where it waits."""
    from torchrec_bagpipe.runtime.id_exchange import IdExchange
    from torchrec_bagpipe.runtime.metrics import RuntimeMetrics
    from torchrec_bagpipe.runtime.worker import CommWorker, MeteredWorker

    coll = NeverAnswers(0, 2)
    metrics = RuntimeMetrics()
    worker = CommWorker("test-peer-loss")
    plans = IdExchange(rank=0, world_size=2, lookahead=1, num_keys=20, collective=False,
                       collectives=coll, worker=MeteredWorker(worker, metrics),
                       metrics=metrics, timeout=0.2)
    try:
        plans.submit(0, np.array([1, 2], dtype=np.int64))
        plans.submit(1, np.array([3], dtype=np.int64))
        # Step 0's exchange runs (and never ends); step 1's waits behind it on the worker.
        plans._pending.popleft()  # as if step 0 had been absorbed by another path
        with pytest.raises(TimeoutError, match=r"rank 0 of 2: the online ID exchange of step 1 "
                                               r".*within 0\.2 s: it awaits rank 1 \(still "
                                               r"queued behind earlier collectives"):
            plans.absorb(1, 1)
        assert plans.waiting_for(0.2).startswith("rank 0 of 2: the online ID exchange of step 1")
    finally:
        coll.release()
        plans.cancel()
        worker.shutdown()


# ---- two gloo ranks, one exits ----------------------------------------------------------------
def _rank_exits_mid_run(rank: int, world_size: int) -> str:
    from torchrec_bagpipe.distributed.process_group_collectives import (
        TorchDistCollectives,
        new_runtime_group,
    )

    # The group's own timeout is longer than the runtime's: whichever comes first (gloo
    # seeing the connection reset, or the runtime's bounded wait), the survivor names the
    # exchange, its step and the rank it awaited.
    coll = TorchDistCollectives(new_runtime_group(60.0))
    if rank == 1:
        os._exit(0)  # dies before exchanging any batch
    ps = ReferencePS(20, DIM, world_size, LR, timeout=5.0)
    cfg = BagPipeConfig(optimization_cache_capacity=1, lookahead=1, ps_timeout=5.0)
    ctl = BagPipeController(cfg, rank=rank, world_size=world_size, dim=DIM, num_keys=20, lr=LR,
                            ps=ps.client(rank), collectives=coll)
    ctl.submit(torch.tensor([1, 2]))
    ctl.submit(torch.tensor([2, 3]))
    try:
        ctl.next_step()
    except Exception as e:  # what the survivor reports
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
def test_a_gloo_peer_that_exits_is_named_by_the_survivor():
    import multiprocessing as mp
    import tempfile

    from _dist import _child

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "pg_init")
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(_rank_exits_mid_run, r, 2, init, results, (),
                                   {"OMP_NUM_THREADS": "1"}))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            rank, status, text = results.get(timeout=120)  # only rank 0 reports
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert (rank, status) == (0, "ok"), text
    assert "rank 0 of 2: the online ID exchange of step 0" in text, text
    assert "awaiting rank 1" in text or "awaits rank 1" in text, text
