"""The step lifecycle of a BagPipe-sharded module (step_lifecycle.py), world 2 over gloo.

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
* Hypothesis over interleavings of forward / backward / optimizer step / state dict / eval /
  no-grad forward / close (one rank, both aggregations): the weights equal the reference at
  every read, and each step commits exactly once per fused table, its own gradient (or zero
  when finished explicitly before its backward).
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


def _tables_only(module):
    """The module's tables as whole plain tensors (a collective: every rank calls it)."""
    import _scenarios as S

    return {k: v for k, v in S.whole_state(module).items()
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
        before = _tables_only(dmp)
        before_opt = S.fused_state(opt) if t == 2 else None
        loss, _ = dmp(b)
        if t in (2, 4):
            # Reads between the forward and its backward: the last finished step's weights
            # (and optimizer state); the pending step stays pending.
            problems += S.compare(_tables_only(dmp), before,
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
    import torch.distributed as dist

    case = S.Case(kind="dlrm", steps=12, seed=6, config={"ps_timeout": 5.0})
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
    case = S.Case(kind="dlrm", steps=3, seed=6, config={"ps_timeout": 5.0})
    dmp, opt = S.make_dmp(case, S.build_model(case.kind, case.seed), world)
    module = bagpipe_modules(dmp)[0][1]
    for b in batches[: 3 if rank == 0 else 2]:
        module.presubmit(b.sparse_features)
    if rank == 0:
        problems.append(_expect_raises(lambda: close_model(dmp), Exception,
                                       "submitted batch 2", "every rank must submit"))
    else:
        close_model(dmp)
    # Rank 0 learns of the missing batch within its ps_timeout; then both shut down (the
    # job's shutdown barrier is bounded by the same timeout, so wait for rank 0 here).
    dist.barrier()
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


def _interleavings_worker(rank: int, world: int, max_examples: int) -> str:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_bagpipe.config import BagPipeConfig
    from torchrec_bagpipe.distributed import (
        BagPipeEmbeddingBagCollectionSharder,
        bagpipe_modules,
        bagpipe_plan,
        close_model,
    )

    lr = 0.25
    # Two fused tables (dims 4 and 2), sum and mean pooling.
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=12, feature_names=["f0"]),
        EmbeddingBagConfig(name="b", embedding_dim=2, num_embeddings=9, feature_names=["f1"],
                           pooling=PoolingType.MEAN),
    ]

    def batch(gen: torch.Generator) -> KeyedJaggedTensor:
        lengths = torch.randint(0, 3, (6,), generator=gen)
        n0 = int(lengths[:3].sum())
        values = torch.cat([torch.randint(0, 12, (n0,), generator=gen),
                            torch.randint(0, 9, (int(lengths.sum()) - n0,), generator=gen)])
        return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], values, lengths)

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=what)

    ops_strategy = st.lists(st.sampled_from(
        ["forward", "forward", "backward", "backward", "optimizer_step", "state_dict", "eval",
         "no_grad_forward", "close"]), min_size=1, max_size=12)

    @settings(max_examples=max_examples, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(ops_strategy, st.integers(0, 2**31 - 1), st.sampled_from(["ps", "collective"]))
    def prop(ops, seed, aggregation):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        ref = EmbeddingBagCollection(tables=tables)
        initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        model = EmbeddingBagCollection(tables=tables)
        model.load_state_dict(initial)
        config = BagPipeConfig(optimization_cache_capacity=2, bagpipe_aggregation=aggregation)
        dmp = DistributedModelParallel(
            model, device=torch.device("cpu"), plan=bagpipe_plan(model, world),
            sharders=[BagPipeEmbeddingBagCollectionSharder(
                config, {"learning_rate": lr, "optimizer": EmbOptimType.EXACT_SGD})])
        part = bagpipe_modules(dmp)[0][1].bagpipe_tables
        table_of = [rt.spec.tables[0].name for rt in part.runtimes]
        commits: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # group, step, U, grad
        for g, rt in enumerate(part.runtimes):
            def recording(step, grad, _g=g, _finish=rt.finish_step):
                commits.append((_g, step.step, step.unique_keys.clone(), grad.clone()))
                _finish(step, grad)
            rt.finish_step = recording  # type: ignore[method-assign]
        ref_params = {n.split(".")[-2]: p for n, p in ref.named_parameters()}
        # What each step's commit must carry: its own row gradients (table -> dense grad),
        # or None: finished with a zero gradient (an explicit end of step, close).
        expected: dict[int, dict[str, torch.Tensor] | None] = {}
        batches = [batch(gen) for _ in range(len(ops) + 1)]
        nxt = 0  # the next training batch
        taken = 0  # steps taken
        pending = None  # [out, ref_out, upstream, step, finished_early]
        closed = False

        def check_weights(what: str) -> None:
            import _scenarios as S

            sd = S.whole_state(dmp)
            for name, p in ref_params.items():
                close(sd[f"embedding_bags.{name}.weight"], p.detach(), f"{what}: {name}")

        try:
            for i, op in enumerate(ops):
                where = f"op {i} ({op}) of {ops}"
                if op == "forward":
                    if pending is not None and not pending[4]:
                        try:
                            dmp(batches[nxt])
                        except RuntimeError as e:
                            assert "waits for its backward" in str(e), e
                        else:
                            raise AssertionError(f"{where}: a second forward was accepted")
                        continue
                    out = dmp(batches[nxt]).wait().values()
                    ref_out = ref(batches[nxt]).values()
                    close(out, ref_out.detach(), where)
                    pending = [out, ref_out, torch.randn(out.shape, generator=gen), taken, False]
                    taken += 1
                    nxt += 1
                elif op == "backward" and pending is not None:
                    out, ref_out, upstream, step, finished = pending
                    pending = None
                    if finished:
                        try:
                            (out * upstream).sum().backward()
                        except RuntimeError as e:
                            assert "already finished" in str(e), e
                        else:
                            raise AssertionError(f"{where}: a finished step took a gradient")
                        continue
                    (out * upstream).sum().backward()
                    (ref_out * upstream).sum().backward()
                    expected[step] = {}
                    with torch.no_grad():
                        for name, p in ref_params.items():
                            expected[step][name] = p.grad.clone()
                            p -= lr * p.grad
                            p.grad = None
                elif op == "optimizer_step":
                    dmp.fused_optimizer.step()
                    if pending is not None and not pending[4]:
                        expected[pending[3]] = None
                        pending[4] = True
                elif op == "state_dict":
                    check_weights(where)
                elif op == "eval":
                    dmp.eval()
                    close(dmp(batches[nxt]).wait().values(), ref(batches[nxt]).values().detach(),
                          where)
                    dmp.train()
                elif op == "no_grad_forward":
                    with torch.no_grad():
                        close(dmp(batches[nxt]).wait().values(), ref(batches[nxt]).values(),
                              where)
                elif op == "close":
                    break
            else:
                check_weights(f"after {ops}")
            close_model(dmp)
            closed = True
            if pending is not None and not pending[4]:
                expected[pending[3]] = None  # close finishes it with a zero gradient
        finally:
            if not closed:
                close_model(dmp)
        # Every step committed once per fused table, in order, with its own gradient.
        got_steps = [(g, s) for g, s, _, _ in commits]
        want_steps = [(g, s) for s in range(taken) for g in range(len(table_of))]
        assert sorted(got_steps) == sorted(want_steps), (got_steps, want_steps, ops)
        for g in range(len(table_of)):  # each fused table's steps commit in order
            mine = [s for h, s in got_steps if h == g]
            assert mine == sorted(mine), (g, got_steps, ops)
        for g, s, unique, grad in commits:
            own = expected[s]
            if own is None:
                assert not grad.any(), (g, s, ops)
            else:
                close(grad, own[table_of[g]][unique], f"step {s} table {table_of[g]}: {ops}")

    prop()
    return "ok"


def test_interleaved_lifecycle_calls_commit_each_step_its_own_gradient():
    assert run_world(_interleavings_worker, 1, args=(60,), timeout=600) == ["ok"]
