"""`ClientSpec`: one rank's session on one PS table and how the client reaches its shards.

A frozen dataclass stating its fields, defaults and checks once (errors name the field):
the table's schema (`TableSchema`'s fields: dim, init, key bound, optimizer), the session
(table name, rank, world size, gradient division, job token, session id, the default lr)
and the protocol (partitioner, packet rows, in-flight window, timeouts). `native()` hands
it to the client (``C.ClientOptions``), `native_connect()` to its transports
(``C.ConnectOptions``). `PSClient(endpoints, spec)` takes it, or its fields as keywords.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, get_args

from torchrec_bagpipe._native import C
from torchrec_bagpipe.config import Partitioner
from torchrec_bagpipe.ps._args import float_arg, int_arg, lr_arg
from torchrec_bagpipe.ps.table_specs import TableSchema

__all__ = ["ClientSpec", "default_session_id"]

_PARTITIONERS: tuple[str, ...] = get_args(Partitioner)  # ps.partitioner.KINDS
_ANY_START_STEP = -2  # wire::kAnyStartStep: Open with no start-step check


def default_session_id(job_token: str, table: str) -> int:
    """The session id every rank of a job derives for `table` (64-bit, never 0)."""
    digest = hashlib.blake2b(f"{job_token}\0{table}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


@dataclass(frozen=True, kw_only=True)
class ClientSpec(TableSchema):
    """A `PSClient`'s settings (csrc/client/ps_client.h ``ClientOptions``, and
    csrc/transport/channel.h ``ConnectOptions``).

    `table`: the PS table's name; its schema is `TableSchema`'s fields (a shard holding the
    table with another schema refuses the session, naming the field). `lr`: the learning
    rate of a commit that passes none (finite, > 0). Rank `rank` of `world_size`;
    `gradient_division`: the PS divides summed gradients by the world size. `job_token`
    authenticates every frame; `session_id` (None: `default_session_id(job_token, table)`)
    names the job's session on the table. `partitioner` routes keys to shards; at most
    `max_packet_rows` rows per packet and `inflight_packets` packets per shard in flight.
    Every operation's one deadline is its submission + `timeout` seconds; connecting a
    remote shard may take `connect_timeout`; a TCP connection that sent nothing for
    `keepalive_interval` seconds sends a keep-alive Ping (0: never; keep it well below the
    servers' idle_timeout).

    `expected_step`: the table's committed step the session starts after, which every shard
    checks when the session opens (the protocol's start step, wire version 3): -1 (the
    default) a new job, refused by a table that already committed steps (its steps 0..s
    would be acknowledged without being applied); s >= 0 a declared resume from step s,
    refused unless the table is at committed step s; None attaches with no check (tools and
    inspection that commit nothing). A refusal raises `StartStepError` naming the table and
    the steps.
    """

    table: str
    lr: float
    rank: int = 0
    world_size: int = 1
    gradient_division: bool = True
    partitioner: str = "modulo"
    job_token: str = ""
    session_id: int | None = None
    max_packet_rows: int = 4096
    inflight_packets: int = 8
    timeout: float = 120.0
    connect_timeout: float = 30.0
    keepalive_interval: float = 30.0
    expected_step: int | None = -1

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.table, str):
            raise TypeError(f"table must be a str, got {type(self.table).__name__}")
        self._check_schema()
        set_(self, "lr", lr_arg(self.lr, "lr"))
        world_size = int_arg(self.world_size, "world_size", minimum=1)
        rank = int_arg(self.rank, "rank", minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} must be below world_size {world_size}")
        set_(self, "rank", rank)
        set_(self, "world_size", world_size)
        set_(self, "gradient_division", bool(self.gradient_division))
        if self.partitioner not in _PARTITIONERS:
            raise ValueError(f"partitioner must be one of {list(_PARTITIONERS)}, got "
                             f"{self.partitioner!r}")
        if not isinstance(self.job_token, str):
            raise TypeError("job_token must be a str")
        if self.session_id is not None:
            session = int_arg(self.session_id, "session_id", minimum=0)
            if session >= 1 << 64:
                raise ValueError("session_id must fit in 64 bits")
            set_(self, "session_id", session)
        timeout = float_arg(self.timeout, "timeout")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        set_(self, "timeout", timeout)
        set_(self, "max_packet_rows", int_arg(self.max_packet_rows, "max_packet_rows", minimum=1))
        set_(self, "inflight_packets",
             int_arg(self.inflight_packets, "inflight_packets", minimum=1))
        set_(self, "connect_timeout", float_arg(self.connect_timeout, "connect_timeout"))
        keepalive = float_arg(self.keepalive_interval, "keepalive_interval")
        if keepalive < 0:
            raise ValueError(f"keepalive_interval must be >= 0 (0: never), got {keepalive}")
        set_(self, "keepalive_interval", keepalive)
        if self.expected_step is not None:
            set_(self, "expected_step", int_arg(self.expected_step, "expected_step", minimum=-1))

    @property
    def session(self) -> int:
        """The session id the client opens (`session_id`, or the job's default for `table`)."""
        if self.session_id is not None:
            return self.session_id
        return default_session_id(self.job_token, self.table)

    def native(self) -> Any:
        """The session and protocol options (a ``C.ClientOptions``)."""
        c = C.ClientOptions()
        self._fill_schema(c)
        c.table = self.table
        c.session = self.session
        c.lr = self.lr
        c.rank = self.rank
        c.world_size = self.world_size
        c.grad_division = self.gradient_division
        c.partition = self.partitioner
        c.max_packet_rows = self.max_packet_rows
        c.inflight_packets = self.inflight_packets
        c.timeout = self.timeout
        c.start_step = _ANY_START_STEP if self.expected_step is None else self.expected_step
        return c

    def native_connect(self) -> Any:
        """How the client connects to remote shards (a ``C.ConnectOptions``)."""
        connect = C.ConnectOptions()
        connect.job_token = self.job_token
        connect.connect_timeout = self.connect_timeout
        connect.keepalive_interval = self.keepalive_interval
        return connect
