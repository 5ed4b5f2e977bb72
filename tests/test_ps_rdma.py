"""The rdma (UCX) transport end to end from Python, with UCX over shared memory (frames
written one-sided into the shard's registered slots) and over TCP (frames carried by their
doorbells), in turn:

* a two-rank, two-shard job over UCX (one rank mixing an in-process shard) ends bitwise equal
  to the same job over the local backend, and the transport counters add up;
* more gets and commits in flight than slots: every read is exact for its step;
* errors: no rdma in the build, an unreachable shard, a mute listener, a wrong token, a shard
  process killed mid-run — each a clear error within its timeout.

The commit-protocol suites run over rdma too (tests/ps_transports.py): Hypothesis packing /
sharding independence (test_ps_protocol), multi-process equality and kill-and-restart
(test_ps_processes), fuzzing of the control path (test_ps_server).
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from torchrec_bagpipe import TransportError
from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps import PSClient, PSShard, rdma, spawn_server

DIM = 4
KEYS = 40
LR = 0.25
INIT = {"init": "uniform", "init_bound": 0.5, "seed": 11, "key_bound": KEYS}

requires_ucx = pytest.mark.skipif(not rdma.HAVE_UCX, reason="this build has no UCX")
TLS = [pytest.param(t, marks=requires_ucx, id=f"ucx-{t}") for t in ("sm", "tcp")]


@pytest.fixture
def tls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("UCX_TLS", request.param)
    return str(request.param)


def batch(step: int, rank: int, rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = np.random.default_rng(step * 1009 + rank)
    n = int(g.integers(0, rows + 1))  # sometimes empty: the rank still sends its markers
    keys = torch.from_numpy(g.integers(0, KEYS, n).astype(np.int64))
    grads = torch.from_numpy((g.integers(-64, 65, (n, DIM)) / 16.0).astype(np.float32))
    return keys, grads


def run_job(endpoints_per_rank: list[list], steps: int, **client_kw) -> np.ndarray:
    clients = [
        PSClient(eps, table="emb", dim=DIM, lr=LR, rank=r, world_size=len(endpoints_per_rank),
                 job_token="tok", timeout=30.0, **INIT, **client_kw)
        for r, eps in enumerate(endpoints_per_rank)
    ]
    errors: list[BaseException] = []

    def rank_loop(r: int) -> None:
        try:
            for t in range(steps):
                clients[r].commit(t, *batch(t, r))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(len(clients))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    rows = clients[0].get(torch.arange(KEYS), steps - 1).numpy()
    run_job.last_stats = [c.channel_stats() for c in clients]  # type: ignore[attr-defined]
    for c in clients:
        c.close()
    return rows


def local_reference(steps: int, world: int = 2, shards: int = 2, **client_kw) -> np.ndarray:
    local = [PSShard(shard_id=i, num_shards=shards) for i in range(shards)]
    return run_job([local] * world, steps, **client_kw)


# ---- availability ---------------------------------------------------------------------

def test_rdma_unavailable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(C.HAVE_UCX, bool)
    assert (C.RDMA_UNAVAILABLE == "") == C.HAVE_UCX
    monkeypatch.setattr(rdma, "HAVE_UCX", False)
    shard = PSShard(shard_id=0, num_shards=1)
    with pytest.raises(rdma.RdmaUnavailableError, match="libucx-dev"):
        PSClient(["ucx://127.0.0.1:1"], table="t", dim=DIM, lr=LR, **INIT)
    with pytest.raises(rdma.RdmaUnavailableError, match="UCX"):
        shard.serve_ucx()
    # The single-node local backend (what the launcher picks on one node) still works.
    with PSClient([shard], table="t", dim=DIM, lr=LR, **INIT) as c:
        c.commit(0, torch.tensor([1]), torch.ones(1, DIM))
        assert c.committed_step() == 0
    shard.close()


def test_rdma_endpoint_names() -> None:
    assert rdma.rdma_endpoint("10.0.0.2:7000") == "ucx://10.0.0.2:7000"
    assert rdma.rdma_endpoint("tcp://h:1") == "ucx://h:1"
    with pytest.raises(ValueError, match="host:port"):
        rdma.rdma_endpoint("nohost")
    with pytest.raises(ValueError, match="host:port"):
        PSClient(["ucx://nohost"], table="t", dim=DIM, lr=LR, **INIT)


# ---- equality with the local backend -------------------------------------------------------

@pytest.mark.parametrize("tls", TLS, indirect=True)
def test_rdma_job_equals_local_backend(tls: str) -> None:
    steps = 15
    want = local_reference(steps)
    shards = [PSShard(shard_id=i, num_shards=2) for i in range(2)]
    servers = [s.serve_ucx(job_token="tok") for s in shards]
    ucx = [srv.address for srv in servers]
    # Rank 0 hosts shard 0 in-process (the trainer-hosted shard); rank 1 reaches both over UCX.
    got = run_job([[shards[0], ucx[1]], ucx], steps, max_packet_rows=3, inflight_packets=4)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # Accounting: every frame went through the transport; put mode writes them one-sided.
    stats = run_job.last_stats  # type: ignore[attr-defined]
    ucx_channels = [stats[0][1], *stats[1]]
    for ch in ucx_channels:
        assert ch["frames_sent"] >= steps  # at least a marker per step
        assert ch["frames_received"] >= ch["frames_sent"]  # an ACK per frame (+ notifications)
        assert ch["doorbells"] >= 1
        if tls == "sm":
            assert ch["one_sided_writes"] == ch["frames_sent"]
            assert ch["doorbells"] <= ch["frames_sent"]
        else:
            assert ch["one_sided_writes"] == 0
            assert ch["doorbells"] == ch["frames_sent"]
    for srv in servers:
        assert srv.stats()["closed_by_server"] == 0
    for s in shards:
        s.close()


@pytest.mark.parametrize("tls", TLS, indirect=True)
def test_rdma_slot_reuse_under_pressure_is_exact(tls: str) -> None:
    steps = 8
    shard = PSShard(shard_id=0, num_shards=1)
    srv = shard.serve_ucx(job_token="tok")
    ref_shard = PSShard(shard_id=0, num_shards=1)
    keys = torch.arange(KEYS)
    kw = dict(table="emb", dim=DIM, lr=LR, job_token="tok", timeout=30.0, max_packet_rows=1,
              inflight_packets=2, **INIT)
    with PSClient([srv.address], **kw) as c, PSClient([ref_shard], **kw) as ref:
        handles = []
        for t in range(steps):  # every commit and read queued at once: ~20 packets per slot
            handles.append(c.commit_async(t, *batch(t, 0, rows=20)))
            handles.append(c.get_async(keys, t))
        for h in handles:
            h.wait()
        for t in range(steps):
            ref.commit(t, *batch(t, 0, rows=20))
            want = ref.get(keys, t).numpy()
            got = handles[2 * t + 1].wait().numpy()
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"step {t}"
        assert c.stats()["ack_waits"] > 0  # the window really was full
    shard.close()
    ref_shard.close()


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tls", TLS, indirect=True)
def test_rdma_unreachable_and_refused(tls: str) -> None:
    kw = dict(table="t", dim=DIM, lr=LR, **INIT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="cannot connect"):
        PSClient([f"ucx://127.0.0.1:{dead}"], connect_timeout=5.0, **kw)
    assert time.monotonic() - t0 < 4
    with socket.socket() as mute:  # accepts connections, never answers the bootstrap
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            PSClient([f"ucx://127.0.0.1:{mute.getsockname()[1]}"], connect_timeout=0.5, **kw)
        assert 0.4 < time.monotonic() - t0 < 4
    shard = PSShard(shard_id=0, num_shards=1)
    srv = shard.serve_ucx(job_token="right")
    with pytest.raises(TransportError, match="wrong job token"):
        PSClient([srv.address], job_token="wrong", **kw)
    shard.close()


@pytest.mark.slow
@pytest.mark.parametrize("tls", TLS, indirect=True)
def test_rdma_server_process_drains_and_a_killed_one_fails_clients_fast(tls: str) -> None:
    kw = dict(table="emb", dim=DIM, lr=LR, job_token="tok", timeout=30.0, **INIT)
    with spawn_server(0, 1, job_token="tok", args=["--transport", "rdma", "--quiet"]) as proc:
        with PSClient([f"ucx://{proc.address}"], **kw) as c:
            for t in range(5):
                c.commit(t, *batch(t, 0))
        assert proc.terminate(30) == 0  # SIGTERM drains and exits 0
    with spawn_server(0, 1, job_token="tok", args=["--transport", "rdma", "--quiet"]) as proc:
        c = PSClient([f"ucx://{proc.address}"], world_size=2, **kw)
        pending = c.commit_async(0, *batch(0, 0))  # waits for rank 1, which never comes
        time.sleep(0.2)
        proc.kill()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"torn|failed|closed"):
            pending.wait(20)
        assert time.monotonic() - t0 < 5  # the torn connection, not the 30 s timeout
        with pytest.raises(TransportError):
            c.commit(1, *batch(1, 0))
        c.close(1)


# ---- many connections, few workers ------------------------------------------------------------

@pytest.mark.parametrize("tls", TLS, indirect=True)
def test_rdma_many_connections_share_a_bounded_set_of_workers(tls: str) -> None:
    """64 established UCX connections to one shard server: the server's UCP workers stay at
    most its progress threads (the connections share them), and every connection works while
    all commit concurrently, each table ending equal to a dict-model reference."""
    n, steps = 64, 3
    shard = PSShard(shard_id=0, num_shards=1)
    srv = shard.serve_ucx(job_token="tok")
    clients = [PSClient([srv.address], table=f"t{i}", dim=DIM, lr=LR, init="zeros",
                        job_token="tok", timeout=30.0, inflight_packets=2)
               for i in range(n)]
    try:
        st = srv.stats()
        assert st["active"] == n
        threads = st["threads"]
        assert 1 <= st["ucx_workers"] <= threads  # not one per connection
        errors: list[BaseException] = []
        expected: list[dict[int, np.ndarray]] = [{} for _ in range(n)]

        def loop(i: int) -> None:
            try:
                for t in range(steps):
                    keys = torch.tensor([i % KEYS, (i + t) % KEYS, 63 + t], dtype=torch.int64)
                    grads = torch.full((3, DIM), float(i + 1) / 8.0 + t)
                    clients[i].commit(t, keys, grads)
                    for k, g in zip(keys.tolist(), grads.numpy(), strict=True):
                        row = expected[i].setdefault(k, np.zeros(DIM, np.float32))
                        row -= np.float32(LR) * g  # plain SGD from zeros, rows summed per key
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        ths = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        assert not errors, errors[:3]
        assert not any(th.is_alive() for th in ths)
        for i, c in enumerate(clients):
            keys = sorted(expected[i])
            got = c.get(torch.tensor(keys), steps - 1).numpy()
            np.testing.assert_array_equal(got, np.stack([expected[i][k] for k in keys]))
        st = srv.stats()
        assert st["ucx_workers"] <= threads
        assert st["closed_by_server"] == 0 and st["ucx_stray"] == 0
    finally:
        for c in clients:
            c.close()
        shard.close()
