"""Optimizers on the PS through its client: per-step learning rates, rows with their state,
reopening a table with another optimizer, state across checkpoint and restore."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ps_reference import ReferencePS

from torchrec_bagpipe import SessionError
from torchrec_bagpipe.ps import PSClient, PSShard
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec, adam_step_size

DIM = 4
KEYS = 16
INIT = {"init": "uniform", "init_bound": 0.5, "seed": 3}
SPECS = {
    "sgd": {"optimizer": "sgd", "weight_decay": 0.01},
    "adagrad": {"optimizer": "adagrad", "eps": 1e-3, "initial_accumulator_value": 0.1},
    "rowwise_adagrad": {"optimizer": "rowwise_adagrad", "eps": 1e-8},
    "adam": {"optimizer": "adam", "beta1": 0.9, "beta2": 0.99, "eps": 1e-6},
}


def spec_of(name: str) -> OptimizerSpec:
    fields = dict(SPECS[name])
    return OptimizerSpec(kind=fields.pop("optimizer"), **fields)


def client(endpoints, **kw) -> PSClient:
    args = {"table": "emb", "dim": DIM, "lr": 0.25, "timeout": 20.0, **INIT}
    args.update(kw)
    return PSClient(endpoints, **args)


def batch(step: int, rank: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 7919 + rank)
    k = torch.randint(0, KEYS, (n,), generator=g)
    v = (torch.randint(-64, 64, (n, DIM), generator=g).float() / 16.0).contiguous()
    return k, v


def same_bits(a: torch.Tensor | np.ndarray, b: np.ndarray) -> bool:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return bool(np.array_equal(a.view(np.uint32), np.asarray(b, dtype=np.float32).view(np.uint32)))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_two_ranks_two_shards_follow_the_schedule(name: str) -> None:
    """Each step at its own lr (Adam: the bias-corrected step size of the global step count);
    weights and state equal the reference bitwise, read back with and without state."""
    spec = spec_of(name)
    shards = [PSShard(shard_id=i, num_shards=2) for i in range(2)]
    clients = [client(shards, rank=r, world_size=2, optimizer=spec) for r in range(2)]
    ref = ReferencePS(DIM, 0.25, 2, **INIT, **SPECS[name])
    assert clients[0].state_dim == ref.state_dim == spec.state_dim(DIM)
    schedule = [0.0, 0.05, 0.1, 0.1, 0.2, 0.05, 0.01]  # warm-up from 0, then decay
    for t, lr in enumerate(schedule):
        if name == "adam":
            lr = adam_step_size(lr, spec.beta1, spec.beta2, t + 1)
        per_rank = [batch(t, r) for r in range(2)]
        handles = [c.commit_async(t, k, g, lr=lr) for c, (k, g) in zip(clients, per_rank)]
        for h in handles:
            h.wait()
        ref.apply_step([(k.numpy(), g.numpy()) for k, g in per_rank], lr)
    keys = torch.arange(KEYS, dtype=torch.int64)
    for c in clients:
        assert same_bits(c.lookup(keys), ref.lookup(range(KEYS)))
        full = c.lookup(keys, with_state=True)
        assert full.shape == (KEYS, DIM + ref.state_dim)
        assert same_bits(full, ref.lookup(range(KEYS), with_state=True))
    # A get at a step, into a caller's buffer, with state.
    out = torch.empty(3, DIM + ref.state_dim)
    got = clients[1].get_async(torch.tensor([5, 1, 5]), len(schedule) - 1, out,
                               with_state=True).wait()
    assert got is out and same_bits(out, ref.lookup([5, 1, 5], with_state=True))
    for c in clients:
        c.close()


def test_lr_is_checked_before_anything_is_sent() -> None:
    shard = PSShard()
    with client([shard], optimizer="adagrad") as c:
        for bad in (float("nan"), float("inf"), -0.1):
            with pytest.raises(ValueError, match="lr"):
                c.commit_async(0, torch.tensor([1]), torch.ones(1, DIM), lr=bad)
        with pytest.raises(TypeError, match="lr"):
            c.commit_async(0, torch.tensor([1]), torch.ones(1, DIM), lr="0.1")
        assert c.committed_step() == -1
        c.commit(0, torch.tensor([1]), torch.ones(1, DIM), lr=0.0)  # a warm-up's first step
        assert c.committed_step() == 0
    with pytest.raises(ValueError, match="lr"):
        client([shard], table="other", lr=-1.0)


def test_ranks_with_different_lrs_fail_the_session() -> None:
    shard = PSShard()
    a = client([shard], rank=0, world_size=2, optimizer="rowwise_adagrad")
    b = client([shard], rank=1, world_size=2, optimizer="rowwise_adagrad")
    ha = a.commit_async(0, torch.tensor([1]), torch.ones(1, DIM), lr=0.1)
    hb = b.commit_async(0, torch.tensor([2]), torch.ones(1, DIM), lr=0.2)
    for h in (ha, hb):
        with pytest.raises(SessionError, match="conflicting lr"):
            h.wait()
    assert shard.committed_step("emb") == -1
    assert "every rank must commit a step with the same learning rate" in (
        shard.table_stats("emb")["failure"])
    for c in (a, b):
        c.close()


def test_assign_with_and_without_state() -> None:
    shard = PSShard()
    with client([shard], optimizer="adam") as c:
        sd = c.state_dim
        assert sd == 2 * DIM
        keys = torch.tensor([3, 7])
        c.commit(0, keys, torch.ones(2, DIM), lr=0.1)
        before = c.lookup(keys, with_state=True)
        # Weights only: the rows keep their state; a new row starts from the initial state.
        c.assign(torch.tensor([3, 9]), torch.full((2, DIM), 2.0))
        after = c.lookup(torch.tensor([3, 9]), with_state=True)
        assert torch.equal(after[:, :DIM], torch.full((2, DIM), 2.0))
        assert torch.equal(after[0, DIM:], before[0, DIM:])
        assert torch.equal(after[1, DIM:], torch.zeros(sd))
        # With state: both are written.
        rows = torch.arange(2 * (DIM + sd), dtype=torch.float32).reshape(2, DIM + sd)
        c.assign(keys, rows, with_state=True)
        assert torch.equal(c.lookup(keys, with_state=True), rows)
        with pytest.raises(ValueError, match=r"rows must have shape \(2, 12\)"):
            c.assign(keys, torch.zeros(2, DIM), with_state=True)
        # The shard's in-process face reads and writes the same layout.
        assert torch.equal(shard.lookup("emb", keys, with_state=True), rows)
        shard.assign("emb", keys, rows + 1, with_state=True)
        assert torch.equal(shard.get("emb", keys, 0, with_state=True), rows + 1)
        assert shard.table_optimizer("emb") == OptimizerSpec(kind="adam")


def test_reopening_a_table_with_another_optimizer_is_refused(tmp_path) -> None:
    shard = PSShard(checkpoint_dir=tmp_path)
    with client([shard], optimizer=spec_of("adagrad")) as c:
        c.commit(0, torch.tensor([1, 2]), torch.ones(2, DIM), lr=0.5)
        c.checkpoint()
    for other, field in [("sgd", "optimizer.kind"), ({"kind": "adagrad", "eps": 0.5},
                                                      "optimizer.eps")]:
        with pytest.raises(ValueError, match=rf"table 'emb'.*{field}"):
            client([shard], optimizer=other)
    want = shard.lookup("emb", torch.arange(4), with_state=True)
    shard.close()
    # A shard restored from the checkpoint holds the table's optimizer and state: a session
    # with another optimizer is refused, one with the same continues exactly.
    restored = PSShard(checkpoint_dir=tmp_path, restore=True)
    assert restored.table_optimizer("emb") == spec_of("adagrad")
    with pytest.raises(ValueError, match=r"table 'emb'.*optimizer\.kind 'rowwise_adagrad'"):
        client([restored], optimizer="rowwise_adagrad")
    with client([restored], optimizer=spec_of("adagrad"), expected_step=0) as c:
        assert c.committed_step() == 0
        assert torch.equal(c.lookup(torch.arange(4), with_state=True), want)
    restored.close()


def test_nan_gradient_poisons_only_its_row() -> None:
    shard = PSShard()
    with client([shard], optimizer="adagrad") as c:
        keys = torch.tensor([1, 2])
        before = c.lookup(torch.tensor([2]), with_state=True)
        grads = torch.tensor([[float("nan")] * DIM, [0.0] * DIM])
        c.commit(0, keys, grads, lr=0.1)
        rows = c.lookup(keys, with_state=True)
        assert torch.isnan(rows[0]).all()
        assert torch.equal(rows[1], before[0])
