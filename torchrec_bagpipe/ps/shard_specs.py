"""How a PS shard runs and is served: `ShardSpec`, `TcpServerSpec`, `UcxServerSpec`.

Frozen dataclasses stating their fields, defaults and checks once (errors name the field);
`native()` hands each to its native component (``C.ShardOptions`` + the tables' store
layout, ``C.TcpServerOptions``, ``C.UcxServerOptions``). `PSShard(spec)`, `shard.serve(spec)`
and `shard.serve_ucx(spec)` take them (or their fields as keywords); the
``torchrec-bagpipe-ps`` program builds them from its flags before it imports torch (this
module does not).
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps._args import float_arg, int_arg, optional_path
from torchrec_bagpipe.ps.table_specs import StoreLayout

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "ShardSpec", "TcpServerSpec", "UcxServerSpec"]

DEFAULT_MAX_FRAME_BYTES = 256 << 20
_MAX_THREADS = 64


@dataclass(frozen=True)
class ShardSpec:
    """A PS shard (csrc/shard/ps_shard.h ``ShardOptions``): shard `shard_id` of
    `num_shards`; `dim`, when given, the only row width it accepts; `store`, the layout of
    every table's store (dim, init, key bound and optimizer come from each table); with
    `checkpoint_dir` each table checkpoints itself every `checkpoint_every` committed steps
    (0: only on request), with `checkpoint_incremental` as a chain: an increment of the rows
    changed since the previous checkpoint, a full base every `checkpoint_full_every`
    increments or once the increments pass `checkpoint_chain_fraction` of the base's bytes
    (csrc/store/embedding_store_incremental.cc), and with `checkpoint_background` written
    by a background thread from a snapshot of their step while later steps commit
    (csrc/store/embedding_store_snapshot.cc); frames above `max_frame_bytes` are refused."""

    shard_id: int = 0
    num_shards: int = 1
    _: KW_ONLY
    dim: int | None = None
    store: StoreLayout = field(default_factory=StoreLayout)
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int = 0
    checkpoint_incremental: bool = True
    checkpoint_full_every: int = 8
    checkpoint_chain_fraction: float = 0.5
    checkpoint_background: bool = False
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "shard_id", int_arg(self.shard_id, "shard_id", minimum=0))
        set_(self, "num_shards", int_arg(self.num_shards, "num_shards", minimum=1))
        if self.shard_id >= self.num_shards:
            raise ValueError(f"shard_id {self.shard_id} must be below num_shards "
                             f"{self.num_shards}")
        if self.dim is not None:
            set_(self, "dim", int_arg(self.dim, "dim", minimum=1))
        if not isinstance(self.store, StoreLayout):
            raise TypeError(f"store must be a StoreLayout, got {type(self.store).__name__}")
        set_(self, "store", self.store.layout)
        set_(self, "checkpoint_every",
             int_arg(self.checkpoint_every, "checkpoint_every", minimum=0))
        set_(self, "checkpoint_dir",
             optional_path(self.checkpoint_dir, "checkpoint_dir") or None)
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        for flag in ("checkpoint_incremental", "checkpoint_background"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool")
        set_(self, "checkpoint_full_every",
             int_arg(self.checkpoint_full_every, "checkpoint_full_every", minimum=1))
        fraction = float_arg(self.checkpoint_chain_fraction, "checkpoint_chain_fraction")
        if not fraction > 0:
            raise ValueError(f"checkpoint_chain_fraction must be > 0, got {fraction}")
        set_(self, "checkpoint_chain_fraction", fraction)
        set_(self, "max_frame_bytes",
             int_arg(self.max_frame_bytes, "max_frame_bytes", minimum=4096))

    def native(self) -> Any:
        """The shard's own options (a ``C.ShardOptions``; the store's: ``store.native()``)."""
        s = C.ShardOptions()
        s.shard_id = self.shard_id
        s.num_shards = self.num_shards
        s.expected_dim = 0 if self.dim is None else self.dim
        s.checkpoint_dir = self.checkpoint_dir or ""
        s.checkpoint_every = self.checkpoint_every
        s.checkpoint_incremental = self.checkpoint_incremental
        s.checkpoint_full_every = self.checkpoint_full_every
        s.checkpoint_chain_fraction = self.checkpoint_chain_fraction
        s.checkpoint_background = self.checkpoint_background
        s.max_frame_bytes = self.max_frame_bytes
        return s


def _threads(value: Any, name: str) -> int:
    n = int_arg(value, name, minimum=1)
    if n > _MAX_THREADS:
        raise ValueError(f"{name} must be in [1, {_MAX_THREADS}], got {n}")
    return n


@dataclass(frozen=True, kw_only=True)
class _ServerSpec:
    """What the TCP and UCX servers share (csrc/server/tcp_server.h, ucx_acceptor.h).

    `handshake_timeout`: seconds from accept to a completed Hello (TCP) or bootstrap (UCX),
    an absolute deadline. At most `max_unauthenticated` connections (and
    `max_unauthenticated_per_host` from one address) may not have authenticated yet: a new
    one sheds the oldest; more than `max_connections` are refused only when every one is
    authenticated. `io_threads` loop threads serve the connections (UCX: the bootstraps). An
    empty `job_token` on a non-loopback `host` is refused unless `allow_no_token`.
    """

    host: str = "127.0.0.1"
    port: int = 0
    job_token: str = ""
    allow_no_token: bool = False
    handshake_timeout: float = 10.0
    max_connections: int = 1024
    max_unauthenticated: int = 256
    max_unauthenticated_per_host: int = 32
    io_threads: int

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.host, str) or not self.host:
            raise TypeError("host must be a non-empty str")
        port = int_arg(self.port, "port", minimum=0)
        if port > 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        set_(self, "port", port)
        if not isinstance(self.job_token, str):
            raise TypeError("job_token must be a str")
        if not isinstance(self.allow_no_token, bool):
            raise TypeError("allow_no_token must be a bool")
        handshake = float_arg(self.handshake_timeout, "handshake_timeout")
        if not handshake > 0:
            raise ValueError(f"handshake_timeout must be > 0, got {handshake}")
        set_(self, "handshake_timeout", handshake)
        for name in ("max_connections", "max_unauthenticated", "max_unauthenticated_per_host"):
            set_(self, name, int_arg(getattr(self, name), name, minimum=1))
        set_(self, "io_threads", _threads(self.io_threads, "io_threads"))

    def _fill(self, target: Any) -> Any:
        target.host = self.host
        target.port = self.port
        target.job_token = self.job_token
        target.allow_no_token = self.allow_no_token
        target.handshake_timeout = self.handshake_timeout
        target.max_connections = self.max_connections
        target.max_unauthenticated = self.max_unauthenticated
        target.max_unauthenticated_per_host = self.max_unauthenticated_per_host
        target.io_threads = self.io_threads
        return target


@dataclass(frozen=True, kw_only=True)
class TcpServerSpec(_ServerSpec):
    """A TCP shard server (``C.TcpServerOptions``): the shared fields above, and
    `idle_timeout`, seconds an authenticated connection may send nothing (clients send
    keep-alives every 30 s; 0: no limit)."""

    io_threads: int = 4
    idle_timeout: float = 300.0

    def __post_init__(self) -> None:
        super().__post_init__()
        idle = float_arg(self.idle_timeout, "idle_timeout")
        if not idle >= 0:
            raise ValueError(f"idle_timeout must be >= 0 (0: no limit), got {idle}")
        object.__setattr__(self, "idle_timeout", idle)

    def native(self) -> Any:
        o = self._fill(C.TcpServerOptions())
        o.idle_timeout = self.idle_timeout
        return o


@dataclass(frozen=True, kw_only=True)
class UcxServerSpec(_ServerSpec):
    """A UCX shard server (``C.UcxServerOptions``; REQUIRES: a build with UCX): the shared
    fields above for its bootstrap connections; `ucx_tls` / `ucx_devices` override
    ``UCX_TLS`` / ``UCX_NET_DEVICES`` for this server (None: the environment's);
    `progress_threads` threads drive every established connection
    (csrc/transport/ucx_progress.h)."""

    io_threads: int = 2
    ucx_tls: str | None = None
    ucx_devices: str | None = None
    progress_threads: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("ucx_tls", "ucx_devices"):
            if not isinstance(getattr(self, name) or "", str):
                raise TypeError(f"{name} must be a str")
        object.__setattr__(self, "progress_threads",
                           _threads(self.progress_threads, "progress_threads"))

    def native(self) -> Any:
        o = self._fill(C.UcxServerOptions())
        o.ucx_tls = self.ucx_tls or ""
        o.ucx_devices = self.ucx_devices or ""
        o.progress_threads = self.progress_threads
        return o
