"""PSClient / PSShard / ShardServer in one process: API, errors, transports, recovery."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from ps_reference import ReferencePS

from torchrec_bagpipe import BagPipeConfig, SessionError, TransportError
from torchrec_bagpipe.ps import (
    Partitioner,
    PSClient,
    PSShard,
    rdma,
    start_local_shards,
    start_tcp_shard,
)
from torchrec_bagpipe.ps.client_spec import ClientSpec, default_session_id
from torchrec_bagpipe.ps.config_specs import client_spec
from torchrec_bagpipe.ps.shard_specs import ShardSpec, TcpServerSpec

DIM = 4
INIT = {"init": "uniform", "init_bound": 0.5, "seed": 11}


def client(endpoints, **kw) -> PSClient:
    args = {"table": "emb", "dim": DIM, "lr": 0.25, "timeout": 20.0, **INIT}
    args.update(kw)
    return PSClient(endpoints, **args)


def batch(step: int, rank: int, n: int = 7, keys: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    k = torch.randint(0, keys, (n,), generator=g)
    v = (torch.randint(-64, 64, (n, DIM), generator=g).float() / 16.0).contiguous()
    return k, v


def same_bits(a: torch.Tensor | np.ndarray, b: np.ndarray) -> bool:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return bool(np.array_equal(a.view(np.uint32), np.asarray(b, dtype=np.float32).view(np.uint32)))


# ---- arguments ------------------------------------------------------------------------------

def test_argument_errors_name_the_argument() -> None:
    shard = PSShard()
    with pytest.raises(ValueError, match="endpoints"):
        client([])
    with pytest.raises(TypeError, match="endpoints"):
        client(shard)
    with pytest.raises(ValueError, match="host:port"):
        client(["localhost"])
    if rdma.HAVE_UCX:  # a UCX endpoint nobody listens on
        with pytest.raises(TransportError, match="cannot connect"):
            client(["ucx://127.0.0.1:5"])
    else:
        with pytest.raises(rdma.RdmaUnavailableError, match="rdma"):
            client(["ucx://127.0.0.1:5"])
    with pytest.raises(TypeError, match=r"endpoints\[0\]"):
        client([3.5])
    with pytest.raises(ValueError, match="rank"):
        client([shard], rank=2, world_size=2)
    with pytest.raises(ValueError, match="partitioner"):
        client([shard], partitioner="range")
    with pytest.raises(ValueError, match="partitioner has 2 shards"):
        client([shard], partitioner=Partitioner("hash", 2))
    with pytest.raises(ValueError, match="init_bound"):
        client([shard], init="uniform", init_bound=None)
    with client([shard]) as c:
        with pytest.raises(TypeError, match=r"keys must have dtype torch\.int64"):
            c.commit_async(0, torch.zeros(2), torch.zeros(2, DIM))
        with pytest.raises(ValueError, match="keys must be 1-D"):
            c.commit_async(0, torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, DIM))
        with pytest.raises(ValueError, match=r"grads must have shape \(2, 4\)"):
            c.commit_async(0, torch.zeros(2, dtype=torch.int64), torch.zeros(2, DIM + 1))
        with pytest.raises(TypeError, match=r"grads must have dtype torch\.float32"):
            c.commit_async(0, torch.zeros(2, dtype=torch.int64), torch.zeros(2, DIM).double())
        with pytest.raises(TypeError, match="contiguous"):
            c.commit_async(0, torch.zeros(4, dtype=torch.int64)[::2], torch.zeros(2, DIM))
        with pytest.raises(ValueError, match="step must be >= 0"):
            c.commit_async(-1, torch.zeros(0, dtype=torch.int64), torch.zeros(0, DIM))
        with pytest.raises(ValueError, match=r"out must have shape"):
            c.get_async(torch.zeros(2, dtype=torch.int64), -1, out=torch.zeros(3, DIM))
        # Nothing above reached the shard: the session is still at step -1.
        assert c.committed_step() == -1
        h = c.commit_async(0, torch.zeros(0, dtype=torch.int64), torch.zeros(0, DIM))
        with pytest.raises(ValueError, match="timeout"):
            h.wait(-1)
        h.wait()


def test_key_bound_is_checked_before_anything_is_sent() -> None:
    shard = PSShard()
    with client([shard], key_bound=10) as c:
        with pytest.raises(ValueError, match=r"key 10 at position 1 is outside \[0, 10\)"):
            c.commit_async(0, torch.tensor([3, 10]), torch.zeros(2, DIM))
        c.commit(0, torch.tensor([3, 9]), torch.ones(2, DIM))
        assert c.committed_step() == 0


def test_session_open_mismatches_are_refused_naming_the_field() -> None:
    shard = PSShard()
    with client([shard], world_size=2):
        for kw, field in [({"optimizer": "adagrad"}, "optimizer.kind"),
                          ({"world_size": 3, "rank": 1}, "world_size"),
                          ({"gradient_division": False}, "gradient_division"),
                          ({"seed": 12}, "seed"), ({"session_id": 99}, "session")]:
            args = {"world_size": 2, "rank": 1, **kw}
            with pytest.raises(ValueError, match=field):
                client([shard], **args)
        with pytest.raises(ValueError, match="dim"):
            client([shard], world_size=2, rank=1, dim=DIM + 1)
        with pytest.raises(ValueError, match="already has the session open"):
            client([shard], world_size=2, rank=0)


def test_shard_level_errors() -> None:
    shard = PSShard(dim=DIM)
    with pytest.raises(ValueError, match="shard_id"):
        PSShard(shard_id=2, num_shards=2)
    with pytest.raises(ValueError, match="--dim"):
        shard.create_table("t", dim=DIM + 1, init="zeros")
    shard.create_table("t", dim=DIM, init="zeros")
    with pytest.raises(ValueError, match="init"):
        shard.create_table("t", dim=DIM, init="constant", init_value=1.0)
    with pytest.raises(ValueError, match="table name"):
        shard.create_table("a/b", dim=DIM, init="zeros")
    with pytest.raises(ValueError, match="does not exist"):
        shard.lookup("nope", torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TimeoutError, match="step 0 was not committed"):
        shard.get("t", torch.zeros(1, dtype=torch.int64), at_step=0, timeout=0.05)


# ---- behaviour -------------------------------------------------------------------------------

def test_two_ranks_two_local_shards_equal_reference() -> None:
    shards = start_local_shards(2)
    ref = ReferencePS(DIM, 0.25, 2, **INIT)
    clients = [client(shards, rank=r, world_size=2, partitioner="hash", max_packet_rows=3,
                      inflight_packets=2) for r in range(2)]
    for t in range(12):
        per_rank = [batch(t, r) for r in range(2)]
        hs = [c.commit_async(t, k, g) for c, (k, g) in zip(clients, per_rank)]
        assert all(isinstance(h.step, int) for h in hs)
        for h in hs:
            assert h.wait() is None
            assert h.done()
        ref.apply_step([(k.numpy(), g.numpy()) for k, g in per_rank])
    keys = torch.arange(30)
    got = clients[1].get_async(keys, 11).wait()
    assert same_bits(got, ref.lookup(keys.tolist()))
    out = torch.empty(30, DIM)
    assert clients[0].get_async(keys, 11, out=out).wait() is out
    assert same_bits(out, ref.lookup(keys.tolist()))
    assert clients[0].committed_step() == 11
    assert clients[0].shard_committed_steps() == [11, 11]
    st = clients[0].stats()
    assert st["commits"] == 12 and st["gets"] == 1
    assert st["packets"] >= 12 * 2  # at least a marker per shard per step
    assert st["bytes_sent"] > 0 and st["bytes_received"] > 0
    for c in clients:
        c.close()
    assert shards[0].table_stats("emb")["attached_ranks"] == 0


def test_get_waits_for_its_step() -> None:
    shard = PSShard()
    a, b = client([shard], rank=0, world_size=2), client([shard], rank=1, world_size=2)
    k = torch.tensor([5, 6])
    ha = a.commit_async(0, k, torch.ones(2, DIM))
    g = a.get_async(k, 0)
    time.sleep(0.05)
    assert not g.done() and not ha.done()  # step 0 still needs rank 1
    b.commit(0, torch.zeros(0, dtype=torch.int64), torch.zeros(0, DIM))
    rows = g.wait()
    ha.wait()
    ref = ReferencePS(DIM, 0.25, 2, **INIT)
    ref.apply_step([(k.numpy(), np.ones((2, DIM), np.float32)),
                    (np.zeros(0, np.int64), np.zeros((0, DIM)))])
    assert same_bits(rows, ref.lookup([5, 6]))
    a.close()
    b.close()


def test_every_operation_has_one_deadline() -> None:
    shard = PSShard()
    with client([shard], world_size=2, timeout=0.4) as a:
        h = a.commit_async(0, torch.tensor([1]), torch.ones(1, DIM))
        with pytest.raises(TimeoutError, match="did not complete"):
            h.wait(0.05)  # the caller's short wait: the operation goes on
        nxt = a.commit_async(1, torch.tensor([1]), torch.ones(1, DIM))  # queued behind step 0
        # Step 0's one deadline (submission + timeout) passes without rank 1 (a lost rank):
        # the client fails, and every pending and later operation raises that at once.
        with pytest.raises(TimeoutError, match=r"commit of step 0 did not complete within 0\.4"):
            nxt.wait(5)
        with pytest.raises(TimeoutError, match="not committed by PS shard 0"):
            h.wait(5)
        with pytest.raises(TimeoutError, match="rank is lost"):
            a.get_async(torch.tensor([1]), -1).wait(5)
        assert "commit of step 0" in a.failure()
        a.close(0.2)  # a failed client closes without draining


def test_a_get_must_follow_its_commit_and_close_is_bounded() -> None:
    shard = PSShard()
    with client([shard], world_size=2, timeout=0.4) as a:
        g = a.get_async(torch.tensor([1]), 7)
        with pytest.raises(TimeoutError, match="must follow the commit"):
            g.wait(5)
        assert a.failure() is None  # a caller's mistake: the client stays usable
        assert a.lookup(torch.tensor([1])).shape == (1, DIM)
    with client([shard], world_size=2, timeout=30) as b:
        b.commit_async(0, torch.tensor([1]), torch.ones(1, DIM))  # rank 1 never commits
        with pytest.raises(TimeoutError, match="pending"):
            b.close(0.2)


def test_assign_lookup_and_barrier_order() -> None:
    shards = start_local_shards(2)
    with client(shards, partitioner="fast_range") as c:
        keys = torch.tensor([1, 2, 3, 1000])
        rows = torch.arange(16, dtype=torch.float32).reshape(4, DIM)
        c.assign(keys, rows)
        assert torch.equal(c.lookup(keys), rows)
        # A commit queued after the assign sees the assigned rows.
        c.commit(0, torch.tensor([2]), torch.ones(1, DIM))
        want = rows[1] - torch.tensor(0.25)
        assert torch.equal(c.lookup(torch.tensor([2]))[0], want)
        assert torch.equal(shards[c.partitioner.shard_of(torch.tensor([2])).item()].lookup(
            "emb", torch.tensor([2]))[0], want)


def test_close_drains_and_later_calls_fail() -> None:
    shard = PSShard()
    c = client([shard])
    handles = [c.commit_async(t, *batch(t, 0)) for t in range(5)]
    c.close()
    assert all(h.done() for h in handles)
    assert shard.committed_step("emb") == 4
    c.close()  # idempotent
    with pytest.raises(SessionError, match="closed"):
        c.commit_async(5, *batch(5, 0)).wait()


def test_dropped_handles_keep_inputs_alive() -> None:
    shard = PSShard()
    with client([shard]) as c:
        for t in range(20):
            k, g = batch(t, 0, n=50)
            c.commit_async(t, k, g)  # the handle and tensors are dropped at once
            del k, g
        assert c.get_async(torch.arange(30), 19).wait().shape == (30, DIM)
    assert shard.committed_step("emb") == 19


def test_checkpoint_and_restore_in_process(tmp_path) -> None:
    shards = [PSShard(ShardSpec(i, 2, checkpoint_dir=tmp_path / f"s{i}")) for i in range(2)]
    ref = ReferencePS(DIM, 0.25, 1, **INIT)
    with client(shards) as c:
        for t in range(4):
            k, g = batch(t, 0)
            c.commit(t, k, g)
            ref.apply_step([(k.numpy(), g.numpy())])
        assert c.checkpoint() == [3, 3]
    restored = [PSShard(ShardSpec(i, 2, checkpoint_dir=tmp_path / f"s{i}"), restore=True)
                for i in range(2)]
    assert restored[0].restored == {"emb": 3}
    with client(restored, expected_step=3) as c:  # a declared resume
        assert c.committed_step() == 3
        assert same_bits(c.lookup(torch.arange(30)), ref.lookup(list(range(30))))
        # Replaying a committed step is a no-op; the next one applies.
        k, g = batch(3, 0)
        c.commit(3, k, g)
        k, g = batch(4, 0)
        c.commit(4, k, g)
        ref.apply_step([(k.numpy(), g.numpy())])
        assert same_bits(c.lookup(torch.arange(30)), ref.lookup(list(range(30))))
    with pytest.raises(ValueError, match="belongs to shard 0 of 2"):
        PSShard(shard_id=1, num_shards=2, restore=tmp_path / "s0")


def test_trainer_hosted_shards_mixed_transports() -> None:
    """Each rank hosts its shard, reaches it in-process and the other rank's over TCP."""
    s0, srv0 = start_tcp_shard(ShardSpec(0, 2), TcpServerSpec(job_token="job"))
    s1, srv1 = start_tcp_shard(ShardSpec(1, 2), TcpServerSpec(job_token="job"))
    c0 = client([s0, srv1.address], rank=0, world_size=2, job_token="job", partitioner="hash")
    c1 = client([f"tcp://{srv0.address}", s1], rank=1, world_size=2, job_token="job",
                partitioner="hash")
    ref = ReferencePS(DIM, 0.25, 2, **INIT)
    for t in range(10):
        per_rank = [batch(t, r) for r in range(2)]
        hs = [c.commit_async(t, k, g) for c, (k, g) in zip((c0, c1), per_rank)]
        for h in hs:
            h.wait()
        ref.apply_step([(k.numpy(), g.numpy()) for k, g in per_rank])
    assert same_bits(c1.lookup(torch.arange(30)), ref.lookup(list(range(30))))
    assert same_bits(c0.lookup(torch.arange(30)), ref.lookup(list(range(30))))
    c0.close()
    c1.close()
    srv0.stop()
    srv1.stop()
    assert srv1.stats()["accepted"] == 1


def test_wrong_job_token_and_shard_order_are_refused() -> None:
    _, srv0 = start_tcp_shard(ShardSpec(0, 2), TcpServerSpec(job_token="right"))
    _, srv1 = start_tcp_shard(ShardSpec(1, 2), TcpServerSpec(job_token="right"))
    with pytest.raises(TransportError, match="job token"):
        client([srv0.address, srv1.address], job_token="wrong")
    with pytest.raises(ValueError, match="shard order"):
        client([srv1.address, srv0.address], job_token="right")
    with client([srv0.address, srv1.address], job_token="right") as c:
        c.commit(0, *batch(0, 0))
    srv0.stop()
    srv1.stop()


def test_dead_shard_fails_every_pending_operation_at_once() -> None:
    _, srv = start_tcp_shard()
    c = client([srv.address], world_size=2, timeout=60.0)
    h = c.commit_async(0, torch.tensor([1]), torch.ones(1, DIM))  # waits for rank 1
    g = c.get_async(torch.tensor([1]), 0)
    time.sleep(0.05)
    t0 = time.monotonic()
    srv.stop()  # the shard goes away
    with pytest.raises(TransportError):
        h.wait()
    with pytest.raises(TransportError):
        g.wait()
    assert time.monotonic() - t0 < 10  # not the 60 s timeout
    with pytest.raises(TransportError):
        c.commit_async(1, torch.tensor([1]), torch.ones(1, DIM)).wait()
    c.close()  # a failed client still closes without raising


def test_session_failure_reaches_every_rank() -> None:
    shard = PSShard()
    a, b = client([shard], rank=0, world_size=2), client([shard], rank=1, world_size=2)
    h = a.commit_async(0, torch.tensor([1]), torch.ones(1, DIM))
    with pytest.raises(SessionError, match="out-of-order step"):
        b.commit(3, torch.tensor([1]), torch.ones(1, DIM))
    with pytest.raises(SessionError, match="out-of-order step"):
        h.wait()
    a.close()
    b.close()
    # Every rank left: a new job may open the table where it stood.
    with client([shard], session_id=7) as c:
        c.commit(0, torch.tensor([1]), torch.ones(1, DIM))


def test_concurrent_ranks_in_threads() -> None:
    shards = start_local_shards(3)
    world = 3
    ref = ReferencePS(DIM, 0.25, world, **INIT)
    for t in range(15):
        ref.apply_step([(k.numpy(), g.numpy()) for k, g in (batch(t, r) for r in range(world))])
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with client(shards, rank=rank, world_size=world, max_packet_rows=2) as c:
                for t in range(15):
                    c.commit(t, *batch(t, rank))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    got = torch.cat([s.lookup("emb", torch.arange(30)).unsqueeze(0) for s in shards])
    owner = Partitioner("modulo", 3).shard_of(torch.arange(30))
    rows = got[owner, torch.arange(30)]
    assert same_bits(rows, ref.lookup(list(range(30))))


def test_client_spec_from_a_config() -> None:
    shard = PSShard()
    cfg = BagPipeConfig(partitioner="hash", max_packet_rows=16, inflight_packets=2,
                        ps_timeout=5.0, gradient_division=False, job_token="tok", init_seed=7)
    spec = client_spec(cfg, table="t", dim=DIM, lr=1.0, rank=0, world_size=1, init="zeros")
    assert isinstance(spec, ClientSpec)
    o = spec.native()
    assert (o.partition, o.max_packet_rows, o.inflight_packets, o.timeout) == ("hash", 16, 2, 5.0)
    assert not o.grad_division and o.init.seed == 7 and o.init.kind == "zeros"
    connect = spec.native_connect()
    assert connect.job_token == "tok" and connect.connect_timeout == 30.0
    assert o.session == default_session_id("tok", "t")
    # The job's agreed token wins over the config's; the config's own fields stay its.
    assert client_spec(cfg, table="t", dim=DIM, lr=1.0, init="zeros",
                       job_token="agreed").native_connect().job_token == "agreed"
    with pytest.raises(TypeError, match="come from the BagPipeConfig"):
        client_spec(cfg, table="t", dim=DIM, lr=1.0, init="zeros", timeout=1.0)
    with PSClient([shard], spec) as c:
        assert c.partitioner.kind == "hash" and c.timeout == 5.0
        c.commit(0, torch.tensor([4, 4]), torch.ones(2, DIM))
        assert torch.equal(c.lookup(torch.tensor([4])), torch.full((1, DIM), -2.0))
