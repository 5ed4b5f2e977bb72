"""The TorchRec integration over the rdma (UCX) transport: a world-2 DMP job with
``ps_type="rdma"`` — each rank hosts its PS shard and serves it over UCX (shared memory here:
frames written one-sided into the shards' registered slots), every rank reaching every shard
through UCX, its own included — trains to the single-process reference, in both aggregation
modes, plain and pipelined loops.
"""

from __future__ import annotations

import _scenarios as S
import pytest
import torch
from _dist import run_world

from torchrec_bagpipe.ps import rdma

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not rdma.HAVE_UCX, reason="this build has no UCX"),
]

WORLD = 2


def _rdma_world(rank: int, world: int) -> list[str]:
    from torchrec_bagpipe.distributed import close_model

    torch.manual_seed(rank)
    problems: list[str] = []
    cfg = {"ps_type": "rdma", "ps_timeout": 30.0}
    cases = [
        S.Case(kind="dlrm", loop="plain", config=dict(cfg), seed=31),
        S.Case(kind="dlrm", loop="pipeline",
               config={**cfg, "optimization_prescan": True, "optimization_cache_capacity": 1,
                       "bagpipe_aggregation": "collective"}, seed=32),
    ]
    for case in cases:
        state, _ = S.train_dmp(case, rank, world)
        if rank == 0:
            problems += S.compare(state, S.train_reference(case, world), "rdma " + case.label())
    # ps_type="rdma" really went through UCX: the deployment's endpoints are ucx:// ones.
    from torchrec_bagpipe.distributed.job import BagPipeJob

    dmp, _ = S.make_dmp(S.Case(kind="dlrm", config=dict(cfg), seed=33),
                        S.build_model("dlrm", 33), world)
    job = BagPipeJob.current()
    if job is None or not all(str(e).startswith("ucx://") for e in job.endpoints):
        problems.append(f"rank {rank}: endpoints are not UCX: {job and job.endpoints}")
    close_model(dmp)
    return problems


def test_rdma_hosted_shards_train_to_the_reference():
    results = run_world(_rdma_world, WORLD, env={"UCX_TLS": "sm"}, timeout=300)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
