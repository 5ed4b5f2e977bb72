"""An independent Python encoder/decoder of the PS wire format (csrc/protocol/wire.h), used by
the protocol tests to drive a shard frame by frame."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = 0x31535042
VERSION = 3  # 3: Open carries the session's start_step

HELLO, HELLO_OK, OPEN, OPEN_OK, COMMIT, ACK, GET, GET_OK = 1, 2, 3, 4, 5, 6, 7, 8
ASSIGN, ASSIGN_OK, CLOSE, CLOSE_OK, CHECKPOINT, CHECKPOINT_OK, PING, PONG = range(9, 17)
ERROR, NOTIFY_COMMITTED, NOTIFY_FAILED, NOTIFY_SHUTDOWN, NOTIFY_CHECKPOINT = 17, 18, 19, 20, 21

OK, INVALID_ARGUMENT, SESSION_FAILED, UNAUTHORIZED, PROTOCOL_ERROR, NOT_OPEN = range(6)
SHUTTING_DOWN, INTERNAL, UNAVAILABLE, START_STEP = range(6, 10)
ANY_START_STEP = -2  # Open's start_step: attach without a check
STORED, DUPLICATE, ALREADY_COMMITTED = 0, 1, 2

HEADER = struct.Struct("<IHHIiQQQ")
HELLO_BODY = struct.Struct("<II")
HELLO_OK_BODY = struct.Struct("<IIQQ")
OPEN_BODY = struct.Struct("<QIIIB3xBBHffIQqdddddq")  # ..., start_step
OPEN_OK_BODY = struct.Struct("<qII")  # committed_step, dim, state_dim
COMMIT_BODY = struct.Struct("<QqIIIIIfII")
ACK_BODY = struct.Struct("<qqIIII")
GET_BODY = struct.Struct("<QqIIII")
GET_OK_BODY = struct.Struct("<qIIII")  # served_step, nrows, dim, state_dim, reserved
STEP_BODY = struct.Struct("<Qq")
MESSAGE_BODY = struct.Struct("<QII")
CLOSE_BODY = struct.Struct("<QII")
CHECKPOINT_NOTE_BODY = struct.Struct("<QqII")
FIXED = {HELLO_OK: HELLO_OK_BODY, OPEN_OK: OPEN_OK_BODY, ACK: ACK_BODY, GET_OK: GET_OK_BODY,
         ASSIGN_OK: STEP_BODY, CLOSE_OK: STEP_BODY, CHECKPOINT_OK: STEP_BODY,
         NOTIFY_COMMITTED: STEP_BODY, ERROR: MESSAGE_BODY, NOTIFY_FAILED: MESSAGE_BODY,
         NOTIFY_SHUTDOWN: MESSAGE_BODY, NOTIFY_CHECKPOINT: CHECKPOINT_NOTE_BODY}
INIT_KINDS = {"uniform": 0, "zeros": 1, "constant": 2}
OPTIMIZER_KINDS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3}

assert HEADER.size == 40 and COMMIT_BODY.size == 48 and OPEN_BODY.size == 104
assert GET_BODY.size == 32 and GET_OK_BODY.size == 24


def token_digest(token: str) -> int:
    mask = (1 << 64) - 1
    h = 0xCBF29CE484222325
    for c in token.encode():
        h = ((h ^ c) * 0x100000001B3) & mask
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & mask
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & mask
    return h ^ (h >> 33)


def frame(msg_type: int, body: bytes, *, job: int = 0, tag: int = 0, slot: int = 0,
          status: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, msg_type, slot, status, tag, job, len(body)) + body


def hello(token: str) -> bytes:
    t = token.encode()
    return frame(HELLO, HELLO_BODY.pack(len(t), 0) + t, job=token_digest(token))


def open_session(table: str, *, session: int, rank: int, world_size: int, dim: int,
                 grad_division: bool = True, init: str = "zeros", init_bound: float = 0.0,
                 init_value: float = 0.0, seed: int = 0, key_bound: int = -1,
                 optimizer: str = "sgd", eps: float = 1e-8, beta1: float = 0.9,
                 beta2: float = 0.999, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, start_step: int = -1, tag: int = 1,
                 job: int = 0) -> bytes:
    """`start_step`: the committed step the session starts after (-1: a new job; s: a
    resume from step s; ANY_START_STEP: no check)."""
    name = table.encode()
    body = OPEN_BODY.pack(session, rank, world_size, dim, OPTIMIZER_KINDS[optimizer],
                          int(grad_division), INIT_KINDS[init], len(name), init_bound,
                          init_value, 0, seed, key_bound, eps, beta1, beta2, weight_decay,
                          initial_accumulator_value, start_step)
    return frame(OPEN, body + name, tag=tag, job=job)


def commit(*, session: int, step: int, rank: int, world_size: int, chunk_index: int,
           chunk_count: int, dim: int, lr: float, keys: np.ndarray, grads: np.ndarray,
           tag: int = 0, slot: int = 0, job: int = 0) -> bytes:
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(len(keys), dim)
    body = COMMIT_BODY.pack(session, step, rank, world_size, chunk_index, chunk_count, dim, lr,
                            len(keys), 0)
    return frame(COMMIT, body + keys.tobytes() + grads.tobytes(), tag=tag, slot=slot, job=job)


def get(*, session: int, at_step: int, dim: int, keys: np.ndarray, state_dim: int = 0,
        tag: int = 0, slot: int = 0, job: int = 0) -> bytes:
    """A read; `state_dim` > 0 (the table's) asks for each row's optimizer state too."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    return frame(GET, GET_BODY.pack(session, at_step, len(keys), dim, state_dim, 0) +
                 keys.tobytes(), tag=tag, slot=slot, job=job)


def close(*, session: int, rank: int, tag: int = 0, job: int = 0) -> bytes:
    return frame(CLOSE, CLOSE_BODY.pack(session, rank, 0), tag=tag, job=job)


@dataclass
class Reply:
    type: int
    status: int
    tag: int
    slot: int
    fields: tuple = ()
    payload: bytes = b""
    extra: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.payload.decode(errors="replace")

    def rows(self, dim: int) -> np.ndarray:
        return np.frombuffer(self.payload, dtype=np.float32).reshape(-1, dim)


def parse(data: bytes) -> Reply:
    magic, version, msg_type, slot, status, tag, _job, body_len = HEADER.unpack_from(data)
    assert magic == MAGIC and version == VERSION
    body = data[HEADER.size:]
    assert len(body) == body_len
    fixed = FIXED.get(msg_type)
    fields: tuple = ()
    if fixed is not None:
        fields = fixed.unpack_from(body)
        body = body[fixed.size:]
    return Reply(msg_type, status, tag, slot, fields, bytes(body))
