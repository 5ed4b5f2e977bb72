"""The commit protocol against a reference model (Hypothesis).

* A RuleBasedStateMachine drives one shard frame by frame for W simulated ranks, for each
  optimizer (SGD, Adagrad, row-wise Adagrad, Adam, with drawn constants) under a learning
  rate that changes from step to step: chunks of a step arrive in any interleaving, with
  duplicates, committed-step retries, deferred and immediate reads (weights only, or with
  their optimizer state), conflicting retries, conflicting learning rates and out-of-order
  steps. After every rule the table's weights and state must equal the reference bitwise, and
  the committed step must match.
* Through PSClient: the final weights do not depend on the shard count, the packet size, the
  in-flight window or the partitioner — over the local transport and over rdma (UCX over
  shared memory, then over TCP).
"""

from __future__ import annotations

import socket

import numpy as np
import ps_wire as w
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from ps_reference import ReferencePS
from ps_transports import endpoint, params, transport_env

from torchrec_bagpipe import SessionError
from torchrec_bagpipe.ps import PSClient, PSShard
from torchrec_bagpipe.testing import _C_testing as tools

DIM = 3
KEYS = 12
SESSION = 4242
INIT = {"init": "uniform", "init_bound": 0.25, "seed": 5}

grad_values = st.integers(-64, 64).map(lambda i: i / 16.0)
# Learning rates of a schedule: 0 (a warm-up's start) and values of several magnitudes.
lr_values = st.sampled_from([0.0, 0.5, 0.125, 0.3, 1.75, 1e-3])


@st.composite
def optimizers(draw: st.DrawFn) -> dict:
    """An optimizer and its constants, as ps_wire.open_session / ReferencePS take them."""
    kind = draw(st.sampled_from(["sgd", "adagrad", "rowwise_adagrad", "adam"]))
    spec: dict = {"optimizer": kind,
                  "weight_decay": draw(st.sampled_from([0.0, 0.0, 0.01, 0.5]))}
    if kind != "sgd":
        spec["eps"] = draw(st.sampled_from([1e-8, 1e-3, 0.1]))
    if kind in ("adagrad", "rowwise_adagrad"):
        spec["initial_accumulator_value"] = draw(st.sampled_from([0.0, 0.1]))
    if kind == "adam":
        spec["beta1"] = draw(st.sampled_from([0.9, 0.0, 0.5]))
        spec["beta2"] = draw(st.sampled_from([0.999, 0.9]))
    return spec


def batch_strategy() -> st.SearchStrategy:
    return st.lists(
        st.tuples(st.integers(0, KEYS - 1), st.lists(grad_values, min_size=DIM, max_size=DIM)),
        max_size=6,
    )


class CommitProtocol(RuleBasedStateMachine):
    """One shard, W ranks, each rank a RawLink that opened the session."""

    @initialize(world=st.integers(1, 3), division=st.booleans(), lr=lr_values,
                optimizer=optimizers())
    def setup(self, world: int, division: bool, lr: float, optimizer: dict) -> None:
        self.world = world
        self.lr = lr
        self.shard = PSShard(shard_id=0, num_shards=1)
        self.links = [tools.RawLink(self.shard.core, True) for _ in range(world)]
        for r, link in enumerate(self.links):
            link.request(w.open_session("t", session=SESSION, rank=r, world_size=world, dim=DIM,
                                        grad_division=division, init="uniform",
                                        init_bound=INIT["init_bound"], seed=INIT["seed"],
                                        **optimizer))
            (reply,) = [w.parse(f) for f in link.take()]
            assert reply.type == w.OPEN_OK, reply.text
        self.ref = ReferencePS(DIM, lr, world, division=division, **INIT, **optimizer)
        assert reply.fields[2] == self.ref.state_dim  # OpenOk announces the state width
        self.step = 0
        self.batches: list[tuple[np.ndarray, np.ndarray]] = []
        self.unsent: list[tuple[int, bytes]] = []  # (rank, frame) of the step being assembled
        self.sent: list[tuple[int, bytes]] = []
        self.history: list[tuple[int, bytes]] = []
        self.deferred: list[tuple[int, int, list[int]]] = []  # (rank, tag, keys) at self.step
        self.failed = False
        self.tag = 100

    # ---- helpers ------------------------------------------------------------------------------
    def request(self, rank: int, frame: bytes) -> list[w.Reply]:
        self.links[rank].request(frame)
        return [w.parse(f) for f in self.links[rank].take()]

    def expect_ack(self, replies: list[w.Reply], disposition: int) -> None:
        acks = [r for r in replies if r.type == w.ACK]
        assert len(acks) == 1, [(r.type, r.text) for r in replies]
        assert acks[0].fields[4] == disposition

    def expect_failure(self, replies: list[w.Reply], text: str) -> None:
        errors = [r for r in replies if r.type == w.ERROR]
        assert errors and errors[0].status == w.SESSION_FAILED, [(r.type, r.text) for r in replies]
        assert text in errors[0].text, errors[0].text

    def step_started(self) -> bool:
        return bool(self.unsent or self.sent)

    # ---- rules -------------------------------------------------------------------------------
    @precondition(lambda self: not self.failed and not self.step_started())
    @rule(data=st.data())
    def new_step(self, data: st.DataObject) -> None:
        # The schedule: the step's lr, carried by every chunk of it (sometimes a new one).
        if data.draw(st.integers(0, 2), label="lr changes") == 0:
            self.lr = data.draw(lr_values, label="lr")
        self.batches = []
        for r in range(self.world):
            rows = data.draw(batch_strategy(), label=f"rank {r} rows")
            keys = np.array([k for k, _ in rows], dtype=np.int64)
            grads = np.array([g for _, g in rows], dtype=np.float32).reshape(len(rows), DIM)
            self.batches.append((keys, grads))
            n = len(rows)
            cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3), label="cuts"))
            bounds = [0, *cuts, n]
            count = len(bounds) - 1
            for c in range(count):
                lo, hi = bounds[c], bounds[c + 1]
                self.unsent.append((r, w.commit(
                    session=SESSION, step=self.step, rank=r, world_size=self.world,
                    chunk_index=c, chunk_count=count, dim=DIM, lr=self.lr,
                    keys=keys[lo:hi], grads=grads[lo:hi], tag=self.step * 100 + c)))

    @precondition(lambda self: not self.failed and not self.step_started())
    @rule(data=st.data())
    def whole_step(self, data: st.DataObject) -> None:
        """A step from start to commit: every chunk in a random order, with duplicates."""
        self.new_step(data)
        while self.unsent:
            if self.sent and data.draw(st.integers(0, 3), label="dup") == 0:
                rank, frame = data.draw(st.sampled_from(self.sent), label="duplicate")
                self.expect_ack(self.request(rank, frame), w.DUPLICATE)
            self.send_chunk(data.draw(st.integers(0, len(self.unsent) - 1), label="chunk"))

    @precondition(lambda self: not self.failed and bool(self.unsent))
    @rule(data=st.data())
    def send_chunks(self, data: st.DataObject) -> None:
        """Sends a few of the step's chunks, in a random order (any rank, any chunk)."""
        for _ in range(data.draw(st.integers(1, len(self.unsent)), label="how many")):
            i = data.draw(st.integers(0, len(self.unsent) - 1), label="chunk")
            self.send_chunk(i)

    def send_chunk(self, i: int) -> None:
        rank, frame = self.unsent.pop(i)
        replies = self.request(rank, frame)
        self.expect_ack(replies, w.STORED)
        self.sent.append((rank, frame))
        if self.unsent:
            assert not any(r.type == w.NOTIFY_COMMITTED for r in replies)
            return
        # The last chunk: the step commits, every rank is told, deferred reads are served.
        self.ref.apply_step(self.batches, self.lr)
        for r, link in enumerate(self.links):
            frames = [w.parse(f) for f in link.take()] + (replies if r == rank else [])
            notes = [f for f in frames if f.type == w.NOTIFY_COMMITTED]
            assert [n.fields[1] for n in notes] == [self.step]
            for rk, tag, keys, state in [d for d in self.deferred if d[0] == r]:
                (got,) = [f for f in frames if f.type == w.GET_OK and f.tag == tag]
                assert got.fields[0] == self.step  # served at exactly the step it waited for
                width = DIM + (self.ref.state_dim if state else 0)
                assert np.array_equal(got.rows(width).view(np.uint32),
                                      self.ref.lookup(keys, with_state=state).view(np.uint32))
                del rk
        self.deferred = []
        self.history.extend(self.sent)
        self.sent = []
        self.step += 1

    @precondition(lambda self: not self.failed and bool(self.sent))
    @rule(data=st.data())
    def duplicate_pending_chunk(self, data: st.DataObject) -> None:
        rank, frame = data.draw(st.sampled_from(self.sent), label="duplicate")
        self.expect_ack(self.request(rank, frame), w.DUPLICATE)

    @precondition(lambda self: not self.failed and bool(self.history))
    @rule(data=st.data())
    def retry_committed_step(self, data: st.DataObject) -> None:
        rank, frame = data.draw(st.sampled_from(self.history), label="retry")
        self.expect_ack(self.request(rank, frame), w.ALREADY_COMMITTED)

    @precondition(lambda self: not self.failed and self.step_started())
    @rule(data=st.data(), state=st.booleans())
    def deferred_get(self, data: st.DataObject, state: bool) -> None:
        rank = data.draw(st.integers(0, self.world - 1), label="rank")
        keys = data.draw(st.lists(st.integers(0, KEYS - 1), max_size=5), label="keys")
        self.tag += 1
        replies = self.request(rank, w.get(session=SESSION, at_step=self.step, dim=DIM,
                                           keys=np.array(keys, dtype=np.int64), tag=self.tag,
                                           state_dim=self.ref.state_dim if state else 0))
        assert not [r for r in replies if r.type in (w.GET_OK, w.ERROR)]
        self.deferred.append((rank, self.tag, keys, state))

    @precondition(lambda self: not self.failed)
    @rule(data=st.data(), state=st.booleans())
    def immediate_get(self, data: st.DataObject, state: bool) -> None:
        keys = data.draw(st.lists(st.integers(0, KEYS - 1), max_size=5), label="keys")
        at = data.draw(st.integers(-1, self.step - 1), label="at_step")
        self.tag += 1
        state_dim = self.ref.state_dim if state else 0
        replies = self.request(0, w.get(session=SESSION, at_step=at, dim=DIM,
                                        keys=np.array(keys, dtype=np.int64), tag=self.tag,
                                        state_dim=state_dim))
        (got,) = [r for r in replies if r.type == w.GET_OK]
        assert got.fields[0] == self.step - 1 and got.fields[3] == state_dim
        assert np.array_equal(got.rows(DIM + state_dim).view(np.uint32),
                              self.ref.lookup(keys, with_state=state).view(np.uint32))

    @precondition(lambda self: not self.failed and self.ref.state_dim > 0)
    @rule()
    def get_of_another_state_width_is_refused(self) -> None:
        self.tag += 1
        replies = self.request(0, w.get(session=SESSION, at_step=-1, dim=DIM,
                                        keys=np.arange(2), tag=self.tag,
                                        state_dim=self.ref.state_dim + 1))
        (err,) = [r for r in replies if r.type == w.ERROR]
        assert err.status == w.INVALID_ARGUMENT and "state_dim" in err.text, err.text

    @precondition(lambda self: not self.failed and bool(self.unsent) and bool(self.sent)
                  and self.step >= 2)
    @rule(data=st.data(), go=st.integers(0, 4))
    def conflicting_lr(self, data: st.DataObject, go: int) -> None:
        """A chunk of the pending step with another learning rate than the step's first."""
        if go:
            return
        rank, frame = self.unsent[0]
        fields = list(w.COMMIT_BODY.unpack_from(frame, w.HEADER.size))
        fields[7] = float(np.float32(fields[7]) + np.float32(0.25))  # the lr field
        body = bytearray(frame)
        w.COMMIT_BODY.pack_into(body, w.HEADER.size, *fields)
        replies = self.request(rank, bytes(body))
        self.expect_failure(replies, "conflicting lr")
        self.failed = True
        self.check_failed_session(rank, replies)

    @precondition(lambda self: not self.failed and bool(self.sent) and self.step >= 2)
    @rule(data=st.data(), go=st.integers(0, 4))
    def conflicting_retry(self, data: st.DataObject, go: int) -> None:
        if go:  # fail sessions rarely and late: long histories before the failure
            return
        rank, frame = data.draw(st.sampled_from(self.sent), label="conflict")
        body = bytearray(frame)
        if len(body) == w.HEADER.size + w.COMMIT_BODY.size:
            # An empty chunk: announce another chunk count instead (also a conflict).
            count_at = w.HEADER.size + 28
            body[count_at] += 1
            text = "chunk_count"
        else:
            body[-1] ^= 0x40  # flip a bit of the last gradient
            text = "different payload"
        replies = self.request(rank, bytes(body))
        self.expect_failure(replies, "conflicting retry")
        assert text in self.shard.table_stats("t")["failure"]
        self.failed = True
        self.check_failed_session(rank, replies)

    @precondition(lambda self: not self.failed and self.step >= 2)
    @rule(rank=st.integers(0, 2), ahead=st.integers(1, 3), go=st.integers(0, 4))
    def out_of_order_step(self, rank: int, ahead: int, go: int) -> None:
        if go:
            return
        rank %= self.world
        frame = w.commit(session=SESSION, step=self.step + ahead, rank=rank,
                         world_size=self.world, chunk_index=0, chunk_count=1, dim=DIM,
                         lr=self.lr, keys=np.zeros(0, np.int64), grads=np.zeros((0, DIM)))
        replies = self.request(rank, frame)
        self.expect_failure(replies, "out-of-order step")
        self.failed = True
        self.check_failed_session(rank, replies)

    @precondition(lambda self: self.failed)
    @rule(data=st.data())
    def after_failure(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.world - 1), label="rank")
        if self.history and data.draw(st.booleans(), label="old"):
            frame = data.draw(st.sampled_from(self.history), label="packet")[1]
            rank = w.COMMIT_BODY.unpack_from(frame, w.HEADER.size)[2]
        else:
            frame = w.get(session=SESSION, at_step=-1, dim=DIM, keys=np.arange(3))
        self.expect_failure(self.request(rank, frame), "failed")

    def check_failed_session(self, sender: int, replies: list[w.Reply]) -> None:
        # Every rank was told; deferred reads failed; every later chunk is refused.
        for r, link in enumerate(self.links):
            frames = [w.parse(f) for f in link.take()] + (replies if r == sender else [])
            assert any(f.type == w.NOTIFY_FAILED for f in frames)
            for rk, tag, _, _ in self.deferred:
                if rk == r:
                    assert any(f.type == w.ERROR and f.tag == tag for f in frames)
        if self.unsent:
            rank, frame = self.unsent[0]
            self.expect_failure(self.request(rank, frame), "failed")

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def table_equals_reference(self) -> None:
        if not hasattr(self, "shard"):
            return
        assert self.shard.committed_step("t") == self.ref.committed
        keys = torch.arange(KEYS, dtype=torch.int64)
        got = self.shard.lookup("t", keys, with_state=True).numpy()
        want = self.ref.lookup(list(range(KEYS)), with_state=True)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))

    def teardown(self) -> None:
        if hasattr(self, "links"):
            event(f"steps committed: {min(self.step, 4)}{'+' if self.step >= 4 else ''}")
            event(f"session failed: {self.failed}")
            for link in self.links:
                link.close()
            if not self.failed:
                assert self.shard.table_stats("t")["attached_ranks"] == 0


CommitProtocol.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCommitProtocol = CommitProtocol.TestCase


# ---- independence of shard count, packet size, window and partitioner --------------------------

def _run_job(num_shards: int, max_rows: int, window: int, partitioner: str, world: int,
             steps: list[list[tuple[np.ndarray, np.ndarray]]], lrs: list[float],
             transport: str = "local", optimizer: dict | None = None) -> np.ndarray:
    """Weights and optimizer state of every key after `steps` (step t at lr lrs[t])."""
    optimizer = dict(optimizer or {"optimizer": "sgd"})
    spec = {"kind": optimizer.pop("optimizer"), **optimizer}
    shards = [PSShard(shard_id=i, num_shards=num_shards) for i in range(num_shards)]
    with transport_env(transport):
        endpoints = [endpoint(s, transport) for s in shards]
        clients = [
            PSClient(endpoints, table="emb", dim=DIM, lr=0.5, rank=r, world_size=world,
                     partitioner=partitioner, max_packet_rows=max_rows, inflight_packets=window,
                     timeout=30.0, optimizer=spec, **INIT)
            for r in range(world)
        ]
    for t, per_rank in enumerate(steps):
        handles = [c.commit_async(t, torch.from_numpy(k), torch.from_numpy(g), lr=lrs[t])
                   for c, (k, g) in zip(clients, per_rank)]
        for h in handles:
            h.wait()
    rows = clients[0].lookup(torch.arange(KEYS, dtype=torch.int64), with_state=True).numpy()
    for c in clients:
        c.close()
    for s in shards:
        s.close()
    return rows


@pytest.mark.parametrize("transport", params("local"))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), world=st.integers(1, 3), shards=st.integers(1, 3),
       max_rows=st.sampled_from([1, 2, 5, 4096]), window=st.sampled_from([1, 2, 8]),
       partitioner=st.sampled_from(["modulo", "hash", "fast_range"]), optimizer=optimizers())
def test_result_independent_of_sharding_and_packing(
    transport: str, data: st.DataObject, world: int, shards: int, max_rows: int, window: int,
    partitioner: str, optimizer: dict
) -> None:
    """Weights and optimizer state, every optimizer, an lr per step."""
    steps = []
    lrs = []
    for _ in range(data.draw(st.integers(1, 4), label="steps")):
        lrs.append(data.draw(lr_values, label="lr"))
        per_rank = []
        for _ in range(world):
            rows = data.draw(batch_strategy())
            keys = np.array([k for k, _ in rows], dtype=np.int64)
            grads = np.array([g for _, g in rows], dtype=np.float32).reshape(len(rows), DIM)
            per_rank.append((keys, grads))
        steps.append(per_rank)
    ref = ReferencePS(DIM, 0.5, world, **INIT, **optimizer)
    for per_rank, lr in zip(steps, lrs):
        ref.apply_step(per_rank, lr)
    got = _run_job(shards, max_rows, window, partitioner, world, steps, lrs, transport, optimizer)
    want = ref.lookup(list(range(KEYS)), with_state=True)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_client_reports_protocol_failures_as_session_errors() -> None:
    shard = PSShard(shard_id=0, num_shards=1)
    with PSClient([shard], table="t", dim=DIM, lr=0.5, world_size=1, **INIT) as c:
        c.commit(0, torch.tensor([1]), torch.ones(1, DIM))
        with pytest.raises(SessionError, match="out-of-order step"):
            c.commit(5, torch.tensor([1]), torch.ones(1, DIM))
        # Sticky: the client is failed; nothing after it runs.
        with pytest.raises(SessionError, match="out-of-order"):
            c.commit(1, torch.tensor([1]), torch.ones(1, DIM))
    assert shard.committed_step("t") == 0


def _read_frame(sock: socket.socket) -> w.Reply:
    head = b""
    while len(head) < w.HEADER.size:
        chunk = sock.recv(w.HEADER.size - len(head))
        assert chunk, "the shard closed the connection"
        head += chunk
    body_len = w.HEADER.unpack_from(head)[-1]
    body = b""
    while len(body) < body_len:
        chunk = sock.recv(body_len - len(body))
        assert chunk, "the shard closed the connection mid-frame"
        body += chunk
    return w.parse(head + body)


def test_independent_encoder_speaks_to_a_tcp_shard() -> None:
    """The Python wire encoder (its own token digest included) against a live TCP shard: a
    Hello with the job's token is accepted and one with another token refused; a session
    opens, commits a step, reads it back and closes, all from hand-built frames."""
    token = "job-token-7"
    shard = PSShard(shard_id=0, num_shards=1)
    server = shard.serve(host="127.0.0.1", port=0, job_token=token)
    job = w.token_digest(token)
    try:
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(w.hello("another-job"))
            reply = _read_frame(s)
            assert reply.type == w.ERROR and reply.status == w.UNAUTHORIZED, reply
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(w.hello(token))
            assert _read_frame(s).type == w.HELLO_OK
            s.sendall(w.open_session("t", session=SESSION, rank=0, world_size=1, dim=DIM,
                                     init="zeros", job=job))
            assert _read_frame(s).type == w.OPEN_OK
            keys = np.array([3, 1, 3], dtype=np.int64)
            grads = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
            s.sendall(w.commit(session=SESSION, step=0, rank=0, world_size=1, chunk_index=0,
                               chunk_count=1, dim=DIM, lr=0.5, keys=keys, grads=grads, tag=2,
                               job=job))
            replies = [_read_frame(s), _read_frame(s)]
            assert sorted(r.type for r in replies) == [w.ACK, w.NOTIFY_COMMITTED], replies
            s.sendall(w.get(session=SESSION, at_step=0, dim=DIM, keys=np.array([1, 3, 5]),
                            tag=3, job=job))
            rows = _read_frame(s)
            assert rows.type == w.GET_OK
            want = np.zeros((3, DIM), dtype=np.float32)
            want[0] = -0.5 * grads[1]
            want[1] = -0.5 * (grads[0] + grads[2])
            np.testing.assert_array_equal(rows.rows(DIM), want)
            s.sendall(w.close(session=SESSION, rank=0, tag=4, job=job))
            closed = _read_frame(s)
            assert closed.type == w.CLOSE_OK and closed.fields[1] == 0, closed
    finally:
        server.stop()
