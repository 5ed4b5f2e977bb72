"""The session's start step is part of the protocol (wire version 3): Open states the committed
step the session starts after (`ClientSpec.expected_step`) and every shard refuses a session
that would renumber the steps it already committed.

* The probe of issue 23: a new job opening a table whose committed step is already 4 (a
  long-lived server reached again, a restored shard) used to have its commits of steps 0..4
  acknowledged and not applied, and read the old job's rows — silently. Now its PSClient is
  refused with a StartStepError naming the table and the steps, and the table is untouched;
  over every transport.
* A declared resume from the committed step opens and its next step is applied; a resume
  from another step is refused; `expected_step=None` attaches without a check (tools).
* The wire: an Open's start_step field is checked (malformed: a protocol error naming it;
  a mismatch: status START_STEP), and a frame of the previous version is refused.
"""

from __future__ import annotations

import numpy as np
import ps_wire as w
import pytest
import torch
from ps_transports import endpoint, params, transport_env

from torchrec_bagpipe.ps import ClientSpec, PSClient, PSShard, StartStepError
from torchrec_bagpipe.testing import _C_testing as tools

DIM = 4
LR = 0.5
KEYS = torch.arange(0, 6, dtype=torch.int64)
TOKEN = "tok-23"


def _client(eps: list, **kw) -> PSClient:
    return PSClient(eps, table="t", dim=DIM, lr=LR, init="zeros", job_token=TOKEN,
                    timeout=30, **kw)


def _grads(step: int) -> torch.Tensor:
    return torch.full((len(KEYS), DIM), float(step + 1))


def _train(c: PSClient, steps: range) -> None:
    for s in steps:
        c.commit(s, KEYS, _grads(s))


@pytest.mark.parametrize("transport", params("local", "tcp"))
def test_a_new_job_on_a_table_at_step_4_is_refused_naming_table_and_steps(transport: str):
    shard = PSShard(shard_id=0, num_shards=1)
    with transport_env(transport):
        eps = [endpoint(shard, transport, TOKEN)]
        with _client(eps) as first:
            _train(first, range(5))  # the first job commits steps 0..4
            before = first.lookup(KEYS)
        assert shard.committed_step("t") == 4
        # The probe: a new job (the default expected_step -1), the same token and session,
        # then another job's session id.
        for session in (None, 99):
            with pytest.raises(StartStepError, match=r"table 't'.*new job.*committed steps up "
                                                     r"to 4.*steps 0\.\.4 would be ackn"):
                _client(eps, session_id=session)
        # Nothing was renumbered or applied; a tool attaching without a check sees the rows.
        assert shard.committed_step("t") == 4
        with _client(eps, expected_step=None) as tool:
            assert tool.opened_steps == [4]
            assert torch.equal(tool.lookup(KEYS), before)
        # A declared resume from step 4 opens, and its step 5 is applied.
        with _client(eps, expected_step=4) as resumed:
            assert resumed.expected_step == 4 and resumed.opened_steps == [4]
            resumed.commit(5, KEYS, _grads(5))
            assert torch.equal(resumed.lookup(KEYS), before - LR * _grads(5))
        assert shard.committed_step("t") == 5
        # A resume from another step is refused too.
        with pytest.raises(StartStepError, match=r"table 't'.*resumes after step 3.*committed "
                                                 r"step is 5"):
            _client(eps, expected_step=3)
        assert shard.committed_step("t") == 5


def test_a_restored_shard_refuses_a_new_job_and_a_resume_from_another_step(tmp_path):
    a = PSShard(shard_id=0, num_shards=2, checkpoint_dir=tmp_path / "a")
    b = PSShard(shard_id=1, num_shards=2, checkpoint_dir=tmp_path / "b")
    with _client([a, b]) as c:
        _train(c, range(2))
        assert c.checkpoint(label="set-1") == [1, 1]
        _train(c, range(2, 4))
    a2 = PSShard(shard_id=0, num_shards=2, restore=tmp_path / "a" / "set-1")
    with pytest.raises(StartStepError, match=r"shard 0.*table 't'.*committed steps up to 1"):
        _client([a2, b])
    # Shards at different steps (not one checkpoint set): whichever step is declared, a shard
    # refuses, named with its step.
    with pytest.raises(StartStepError, match=r"shard 1.*resumes after step 1.*committed step "
                                             r"is 3"):
        _client([a2, b], expected_step=1)
    with pytest.raises(StartStepError, match=r"shard 0.*resumes after step 3.*committed step "
                                             r"is 1"):
        _client([a2, b], expected_step=3)
    b2 = PSShard(shard_id=1, num_shards=2, restore=tmp_path / "b" / "set-1")
    with _client([a2, b2], expected_step=1) as c:
        c.commit(2, KEYS, _grads(2))
    # A resume declared on a fresh shard (not restored) is refused.
    with pytest.raises(StartStepError, match=r"resumes after step 1.*no committed step"):
        _client([PSShard()], expected_step=1)


def test_expected_step_is_checked_by_the_spec():
    with pytest.raises(ValueError, match="expected_step must be >= -1"):
        ClientSpec(table="t", dim=4, lr=0.1, init="zeros", expected_step=-2)
    with pytest.raises(TypeError, match="expected_step must be an int"):
        ClientSpec(table="t", dim=4, lr=0.1, init="zeros", expected_step="4")
    assert ClientSpec(table="t", dim=4, lr=0.1, init="zeros").native().start_step == -1
    attach = ClientSpec(table="t", dim=4, lr=0.1, init="zeros", expected_step=None)
    assert attach.native().start_step == -2
    assert issubclass(StartStepError, ValueError)


# ---- the wire ---------------------------------------------------------------------------------
def _open(link, **kw) -> w.Reply:
    link.request(w.open_session("t", session=7, rank=0, world_size=1, dim=DIM, **kw))
    (reply,) = [w.parse(f) for f in link.take()]
    return reply


def test_the_open_frame_carries_the_start_step():
    shard = PSShard(shard_id=0, num_shards=1)
    link = tools.RawLink(shard.core, True)
    # Malformed: below -2 is a protocol error naming the field; the link stays usable.
    reply = _open(link, start_step=-3)
    assert reply.type == w.ERROR and reply.status == w.PROTOCOL_ERROR, reply
    assert "start_step -3" in reply.text
    # A resume declared on a fresh table: refused with its own status, naming both steps.
    reply = _open(link, start_step=0)
    assert reply.type == w.ERROR and reply.status == w.START_STEP, reply
    assert "table 't'" in reply.text and "resumes after step 0" in reply.text
    reply = _open(link, start_step=-1)
    assert reply.type == w.OPEN_OK and reply.fields[0] == -1, reply
    link.request(w.commit(session=7, step=0, rank=0, world_size=1, chunk_index=0,
                          chunk_count=1, dim=DIM, lr=LR, keys=np.array([1]),
                          grads=np.ones((1, DIM)), tag=2))
    link.request(w.close(session=7, rank=0, tag=3))
    link.take()
    assert shard.committed_step("t") == 0
    other = tools.RawLink(shard.core, True)
    reply = _open(other, start_step=-1)
    assert reply.status == w.START_STEP and "committed steps up to 0" in reply.text, reply
    reply = _open(other, start_step=w.ANY_START_STEP)
    assert reply.type == w.OPEN_OK and reply.fields[0] == 0, reply


def test_an_open_of_the_previous_wire_version_is_refused():
    shard = PSShard(shard_id=0, num_shards=1)
    link = tools.RawLink(shard.core, True)
    v3 = w.open_session("t", session=7, rank=0, world_size=1, dim=DIM)
    # Version 2: the header's version, and its 96-byte Open body (no start_step).
    old = bytearray(v3[:w.HEADER.size + 96] + b"t")
    w.HEADER.pack_into(old, 0, w.MAGIC, 2, w.OPEN, 0, 0, 1, 0, 97)
    assert link.request(bytes(old)) is False  # refused, the connection closes
    (reply,) = [w.parse(f) for f in link.take()]
    assert reply.status == w.PROTOCOL_ERROR and "protocol version 2" in reply.text, reply
    # The current version with the old body size: the table name's length does not match.
    link = tools.RawLink(shard.core, True)
    short = bytearray(old)
    w.HEADER.pack_into(short, 0, w.MAGIC, w.VERSION, w.OPEN, 0, 0, 1, 0, 97)
    link.request(bytes(short))
    (reply,) = [w.parse(f) for f in link.take()]
    assert reply.status == w.PROTOCOL_ERROR and "Open" in reply.text, reply
    assert "t" not in shard.tables()
