"""The step lifecycle of a BagPipe-sharded module (bagpipe_tables.py), world 2 over gloo.

* Between a training forward and its backward: a state dict, the fused optimizer's state and
  an eval forward see the weights as of the last finished step; a second training forward
  and a state-dict load raise (nothing committed, nothing written), and the backward then
  commits the step's own gradient: the weights equal the single-process reference.
* A training-mode forward under `torch.no_grad()` on one rank only is an eval read: it takes
  no step, and training goes on exactly.
* A batch refused by one fused table (a prescan mismatch in its features) is submitted to
  none: training goes on with the planned batches, exactly.
* `close()` with batches submitted but never run: every rank runs the ID exchanges of the
  batches it submitted (no peer left in a collective); a rank that submitted more gets a
  clear error naming the batch, the other closes cleanly.
* Ranks whose local batches differ in size train as stock TorchRec defines it (each rank's
  mean loss; the sparse gradients summed and divided by the world size, as TorchRec's
  all-to-all backward and DDP do): the reference is one process summing the ranks' mean
  losses over W.
"""

from __future__ import annotations

import os
import sys

import pytest
from _dist import run_world

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.slow


def _expect_raises(fn, exc, *needles) -> str | None:
    try:
        fn()
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        return f"{exc.__name__} lacks {missing}: {e}" if missing else None
    return f"expected {exc.__name__}, nothing raised"


def _tables_only(sd):
    return {k: v.detach().clone() for k, v in sd.items()
            if "embedding_bags." in k or "embeddings." in k}


def _between_forward_and_backward(rank: int, world: int) -> list[str]:
    import _scenarios as S
    import torch

    from torchrec_bagpipe.distributed import close_model

    torch.manual_seed(0)
    problems: list[str | None] = []
    case = S.Case(kind="mean", steps=6, seed=3, optimizer="adagrad")
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    samples = S.make_samples(case.kind, case.steps, world, case.batch, case.seed)
    batches = S.batches_for(case.kind, samples, rank, case.seed)
    for t, b in enumerate(batches):
        opt.zero_grad()
        if t == 1 and rank == 0:
            # Rank 0 alone: a training-mode forward without autograd is an eval read.
            with torch.no_grad():
                dmp(batches[4])
                dmp(batches[5])
        before = _tables_only(dmp.state_dict())
        before_opt = S.fused_state(opt) if t == 2 else None
        loss, _ = dmp(b)
        if t in (2, 4):
            # Reads between the forward and its backward: the last finished step's weights
            # (and optimizer state); the pending step stays pending.
            problems += S.compare(_tables_only(dmp.state_dict()), before,
                                  f"state dict during step {t}", rtol=0, atol=0)
            if before_opt is not None:
                problems += S.compare(S.fused_state(opt), before_opt,
                                      f"optimizer state during step {t}", rtol=0, atol=0)
            # An eval forward reads the same weights.
            ebc = dmp.module.ebc
            ebc.eval()
            got = ebc(batches[0].sparse_features).wait().values()
            ebc.train()
            ref = S.build_model(case.kind, case.seed)
            ref.load_state_dict({**ref.state_dict(), **before})
            want = ref.ebc(batches[0].sparse_features).values()
            if not torch.equal(got, want):
                problems.append(f"eval forward during step {t} differs "
                                f"({(got - want).abs().max()})")
            # A load and a second training forward (the next batch) are refused: nothing is
            # written or committed; the next batch stays submitted.
            problems.append(_expect_raises(lambda before=before: dmp.load_state_dict(
                {**dmp.state_dict(), **before}), RuntimeError, "waits for its backward"))
            problems.append(_expect_raises(lambda t=t: dmp(batches[t + 1]), RuntimeError,
                                           "waits for its backward", "stays submitted"))
        loss.backward()
        opt.step()
        if t == 2:
            # Only the batch left submitted may enter next (then it does, at t == 3).
            problems.append(_expect_raises(lambda: dmp(batches[0]), RuntimeError,
                                           "submitted ahead"))
    got = S.full_state(dmp, rank)
    got.update(S.fused_state(opt))
    close_model(dmp)
    if rank == 0:
        problems += S.compare(got, S.train_reference(case, world), "lifecycle training")
    return [p for p in problems if p]


def test_reads_eval_and_second_forward_between_forward_and_backward():
    assert run_world(_between_forward_and_backward, 2) == [[], []]


def _all_fused_tables_or_none(rank: int, world: int) -> list[str]:
    import _scenarios as S
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.distributed import close_model, prescan_model

    problems: list[str | None] = []
    # Three fused tables (dims 4, 8, 6); prescan checks every submitted batch.
    case = S.Case(kind="mean", steps=4, seed=4, config={"optimization_prescan": True})
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    samples = S.make_samples(case.kind, case.steps, world, case.batch, case.seed)
    batches = S.batches_for(case.kind, samples, rank, case.seed)
    prescan_model(dmp, batches)
    for t, b in enumerate(batches):
        if t == 1:
            # The batch with one f2 id changed: only fused table "c" (dim 6) sees a
            # difference from its prescanned trace. Nothing is submitted anywhere.
            kjt = b.sparse_features
            values = kjt.values().clone()
            f2 = kjt.keys().index("f2")
            start = int(sum(kjt.length_per_key()[:f2]))
            if kjt.length_per_key()[f2] == 0:
                raise AssertionError("test data: f2 has no ids in batch 1")
            values[start] = (values[start] + 1) % 20
            bad = S.Batch(dense_features=b.dense_features, labels=b.labels,
                          sparse_features=KeyedJaggedTensor(
                              keys=kjt.keys(), values=values, lengths=kjt.lengths(),
                              weights=kjt.weights_or_none()))
            problems.append(_expect_raises(lambda bad=bad: dmp(bad), ValueError,
                                           "prescan plan mismatch at step 1"))
        opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        opt.step()
    got = S.full_state(dmp, rank)
    close_model(dmp)
    if rank == 0:
        problems += S.compare(got, S.train_reference(case, world), "after a refused batch")
    return [p for p in problems if p]


def test_a_batch_reaches_every_fused_table_or_none():
    assert run_world(_all_fused_tables_or_none, 2) == [[], []]


def _close_with_submitted_batches(rank: int, world: int) -> list[str]:
    import _scenarios as S

    from torchrec_bagpipe.distributed import bagpipe_metrics, bagpipe_modules, close_model

    problems: list[str | None] = []
    case = S.Case(kind="dlrm", steps=12, seed=6, config={"ps_timeout": 10.0})
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    samples = S.make_samples(case.kind, case.steps, world, case.batch, case.seed)
    batches = S.batches_for(case.kind, samples, rank, case.seed)
    module = bagpipe_modules(dmp)[0][1]
    for b in batches:  # every batch enters the window; one runs
        module.presubmit(b.sparse_features)
    loss, _ = dmp(batches[0])
    loss.backward()
    opt.step()
    close_model(dmp)
    # Every rank ran the ID exchange (one all-gather each) of every batch it submitted.
    issued = [m["collectives_issued"] for m in bagpipe_metrics(dmp).values()]
    if issued != [len(batches)] * len(issued):
        problems.append(f"rank {rank}: exchanges run {issued}, {len(batches)} submitted")

    # A rank that submitted one batch more than its peer: a clear error there, a clean close
    # on the peer.
    case = S.Case(kind="dlrm", steps=3, seed=6, config={"ps_timeout": 10.0})
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    module = bagpipe_modules(dmp)[0][1]
    for b in batches[: 3 if rank == 0 else 2]:
        module.presubmit(b.sparse_features)
    if rank == 0:
        problems.append(_expect_raises(lambda: close_model(dmp), Exception,
                                       "submitted batch 2", "every rank must submit"))
    else:
        close_model(dmp)
    return [p for p in problems if p]


def test_close_with_batches_submitted_but_never_run():
    assert run_world(_close_with_submitted_batches, 2, timeout=300) == [[], []]


def _different_local_batch_sizes(rank: int, world: int, kind: str) -> list[str]:
    import _scenarios as S
    import torch

    from torchrec_bagpipe.distributed import close_model

    case = S.Case(kind=kind, steps=5, seed=8, batch=7)
    # Local batch sizes per step: rank 0 keeps 7 samples, rank 1 fewer (the last batch of
    # an epoch: 2).
    sizes = [[7, 4], [7, 7], [7, 1], [7, 5], [3, 2]]
    samples = S.make_samples(kind, case.steps, world, case.batch, case.seed)
    samples = [[step[r][: sizes[t][r]] for r in range(world)] for t, step in enumerate(samples)]
    dmp, opt = S.make_dmp(case, S.build_model(kind, case.seed), world)
    for b in S.batches_for(kind, samples, rank, case.seed):
        opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        opt.step()
    got = S.full_state(dmp, rank)
    close_model(dmp)
    if rank != 0:
        return []
    # The reference: one process, the ranks' mean losses summed and divided by W (TorchRec:
    # each rank's gradient of its own mean loss, summed and divided by the world size, for
    # its sharded tables' all-to-all backward and DDP's dense all-reduce alike).
    model = S.build_model(kind, case.seed)
    tables = [p for n, p in model.named_parameters() if "embedding_bags." in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags." not in n]
    emb_opt = torch.optim.SGD(tables, lr=S.EMB_LR)
    dense_opt = torch.optim.SGD(dense, lr=S.DENSE_LR)
    per_rank = [S.batches_for(kind, samples, r, case.seed) for r in range(world)]
    for t in range(case.steps):
        emb_opt.zero_grad()
        dense_opt.zero_grad()
        loss = sum(model(per_rank[r][t])[0] for r in range(world)) / world
        loss.backward()
        emb_opt.step()
        dense_opt.step()
    want = {k: v.detach() for k, v in model.state_dict().items()}
    return S.compare(got, want, f"{kind}, local batch sizes {sizes}")


@pytest.mark.parametrize("kind", ["mean", "weighted"])
def test_ranks_with_different_local_batch_sizes(kind):
    assert run_world(_different_local_batch_sizes, 2, args=(kind,)) == [[], []]
