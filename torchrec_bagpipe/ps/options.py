"""Typed options of the native PS components, and the one place a `BagPipeConfig` becomes them.

Every native component takes its settings as one options struct, the component's own C++
struct bound field by field (`torchrec_bagpipe._C`): `InitSpec`, `OptimizerSpec`,
`StoreOptions` (an
`EmbeddingStore`, or every table of a PS shard), `LoadOverrides`, `TableSchema`,
`ShardOptions`, `ClientOptions` + `ConnectOptions` (a `PSClient` and how it reaches remote
shards), `TcpServerOptions`, `UcxServerOptions`. The builders below check every value (errors
name the argument as the caller spelled it) and fill the struct: the keyword APIs of
`EmbeddingStore`, `PSShard`, `PSClient` and the servers call them, and `client_options` /
`shard_options` derive them from a `BagPipeConfig` (the TorchRec deployment and the
`torchrec-bagpipe-ps` program use those; nothing else reads PS settings off a config).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchrec_bagpipe._native import C
from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.ps._args import budget_arg, float_arg, int_arg, lr_arg, optional_path
from torchrec_bagpipe.ps.optimizers import OptimizerSpec
from torchrec_bagpipe.ps.partitioner import KINDS as PARTITIONERS

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "INIT_KINDS",
    "PARTITIONERS",
    "PSClientOptions",
    "PSShardOptions",
    "client_options",
    "default_session_id",
    "init_spec",
    "load_overrides",
    "optimizer_spec",
    "ps_client_options",
    "ps_shard_options",
    "shard_options",
    "store_options",
    "table_schema",
    "tcp_server_options",
    "ucx_server_options",
]

DEFAULT_MAX_FRAME_BYTES = 256 << 20
INIT_KINDS = ("uniform", "zeros", "constant")


@dataclass(frozen=True)
class PSClientOptions:
    """A `PSClient`'s settings: the session and protocol (`client`, a ``C.ClientOptions``)
    and how remote shards are reached (`connect`, a ``C.ConnectOptions``)."""

    client: Any
    connect: Any


@dataclass(frozen=True)
class PSShardOptions:
    """A `PSShard`'s settings: the shard (`shard`, a ``C.ShardOptions``) and the store every
    table it creates gets (`store`, a ``C.StoreOptions``; dim, init and key bound come from
    each table)."""

    shard: Any
    store: Any


def default_session_id(job_token: str, table: str) -> int:
    """The session id every rank of a job derives for `table` (64-bit, never 0)."""
    digest = hashlib.blake2b(f"{job_token}\0{table}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


# ---- stores and tables ---------------------------------------------------------------------
def init_spec(
    init: Any = "uniform",
    init_bound: Any = None,
    init_value: Any = 0.0,
    seed: Any = 0,
    key_bound: int | None = None,
) -> Any:
    """How never-written rows read (a ``C.InitSpec``). `init_bound` is a float, a list of
    ``(start_key, bound)`` ranges, or None: ``sqrt(1 / key_bound)``."""
    if init not in INIT_KINDS:
        raise ValueError(f"init must be one of {list(INIT_KINDS)}, got {init!r}")
    seed = int_arg(seed, "seed")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    spec = C.InitSpec()
    spec.kind = init
    spec.value = float_arg(init_value, "init_value")
    spec.seed = seed
    if init != "uniform":
        return spec
    if init_bound is None:
        if key_bound is None or key_bound == 0:
            raise ValueError(
                "init_bound is required for init='uniform' without key_bound (TorchRec's "
                "default is sqrt(1 / num_embeddings) of each table)"
            )
        spec.bound = math.sqrt(1.0 / key_bound)
    elif isinstance(init_bound, numbers.Real) and not isinstance(init_bound, bool):
        bound = float_arg(init_bound, "init_bound")
        if bound < 0:
            raise ValueError(f"init_bound must be >= 0, got {bound}")
        spec.bound = bound
    elif isinstance(init_bound, Sequence) and not isinstance(init_bound, str):
        if not init_bound:
            raise ValueError("init_bound: the list of (start_key, bound) ranges is empty")
        starts: list[int] = []
        bounds: list[float] = []
        for i, item in enumerate(init_bound):
            if not (isinstance(item, Sequence) and len(item) == 2):
                raise TypeError(f"init_bound[{i}] must be a (start_key, bound) pair")
            starts.append(int_arg(item[0], f"init_bound[{i}][0]"))
            b = float_arg(item[1], f"init_bound[{i}][1]")
            if b < 0:
                raise ValueError(f"init_bound[{i}][1] must be >= 0, got {b}")
            bounds.append(b)
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError("init_bound: range starts must be strictly increasing")
        spec.bound_starts = starts
        spec.bound_values = bounds
    else:
        raise TypeError(
            "init_bound must be None, a float or a list of (start_key, bound) pairs, got "
            f"{type(init_bound).__name__}"
        )
    return spec


def optimizer_spec(optimizer: Any = "sgd") -> Any:
    """A store's optimizer (a ``C.OptimizerSpec``) from a `ps.optimizers.OptimizerSpec`, a
    kind name or a dict of its fields (checked there: errors name ``optimizer.<field>``)."""
    spec = OptimizerSpec.of(optimizer)
    o = C.OptimizerSpec()
    o.kind = spec.kind
    o.eps = spec.eps
    o.beta1 = spec.beta1
    o.beta2 = spec.beta2
    o.weight_decay = spec.weight_decay
    o.initial_accumulator_value = spec.initial_accumulator_value
    return o


def _key_bound(key_bound: Any) -> int | None:
    return None if key_bound is None else int_arg(key_bound, "key_bound", minimum=1)


def _table_store(
    num_shards: Any = 16,
    num_threads: Any = 1,
    memory_budget: Any = None,
    spill_dir: Any = None,
    high_watermark: Any = 0.8,
    low_watermark: Any = 0.6,
    page_rows: Any = None,
) -> Any:
    o = C.StoreOptions()
    o.num_shards = int_arg(num_shards, "num_shards", minimum=1)
    o.num_threads = int_arg(num_threads, "num_threads", minimum=1)
    o.memory_budget = budget_arg(memory_budget)
    o.spill_dir = optional_path(spill_dir, "spill_dir")
    o.high_watermark = float_arg(high_watermark, "high_watermark")
    o.low_watermark = float_arg(low_watermark, "low_watermark")
    o.page_rows = 0 if page_rows is None else int_arg(page_rows, "page_rows", minimum=1)
    return o


def store_options(
    dim: int,
    *,
    num_shards: int = 16,
    num_threads: int = 1,
    init: str = "uniform",
    init_bound: float | Sequence[tuple[int, float]] | None = None,
    init_value: float = 0.0,
    seed: int = 0,
    key_bound: int | None = None,
    memory_budget: int | str | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    high_watermark: float = 0.8,
    low_watermark: float = 0.6,
    page_rows: int | None = None,
    optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
) -> Any:
    """An `EmbeddingStore`'s options (a ``C.StoreOptions``); arguments as EmbeddingStore."""
    dim = int_arg(dim, "dim", minimum=1)
    optimizer = optimizer_spec(optimizer)
    key_bound = _key_bound(key_bound)
    spec = init_spec(init, init_bound, init_value, seed, key_bound)
    o = _table_store(num_shards, num_threads, memory_budget, spill_dir, high_watermark,
                     low_watermark, page_rows)
    o.dim = dim
    o.init = spec
    o.optimizer = optimizer
    o.key_bound = -1 if key_bound is None else key_bound
    return o


def load_overrides(
    *,
    dim: int | None = None,
    num_shards: int | None = None,
    num_threads: int | None = None,
    key_bound: int | None = None,
    memory_budget: int | str | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    high_watermark: float | None = None,
    low_watermark: float | None = None,
    page_rows: int | None = None,
    weights_only: bool = False,
    optimizer: OptimizerSpec | str | dict[str, Any] | None = None,
) -> Any:
    """Options of `EmbeddingStore.load` (a ``C.LoadOverrides``); None: from the checkpoint
    (`optimizer`: an expectation of a full load, the new optimizer of a weights-only one)."""

    def opt_int(value: Any, name: str, minimum: int) -> int | None:
        return None if value is None else int_arg(value, name, minimum=minimum)

    def opt_float(value: Any, name: str) -> float | None:
        return None if value is None else float_arg(value, name)

    if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
        raise TypeError(f"spill_dir must be a path, got {type(spill_dir).__name__}")
    o = C.LoadOverrides()
    o.optimizer = None if optimizer is None else optimizer_spec(optimizer)
    o.dim = opt_int(dim, "dim", 1)
    o.num_shards = opt_int(num_shards, "num_shards", 1)
    o.num_threads = opt_int(num_threads, "num_threads", 1)
    o.key_bound = opt_int(key_bound, "key_bound", 1)
    o.page_rows = opt_int(page_rows, "page_rows", 1)
    o.memory_budget = None if memory_budget is None else budget_arg(memory_budget)
    o.spill_dir = None if spill_dir is None else os.fspath(spill_dir)
    o.high_watermark = opt_float(high_watermark, "high_watermark")
    o.low_watermark = opt_float(low_watermark, "low_watermark")
    o.weights_only = bool(weights_only)
    return o


def table_schema(
    dim: int,
    *,
    init: str = "uniform",
    init_bound: float | Sequence[tuple[int, float]] | None = None,
    init_value: float = 0.0,
    seed: int = 0,
    key_bound: int | None = None,
    optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
) -> Any:
    """A PS table (a ``C.TableSchema``): row width, init of never-written rows, key bound,
    the optimizer its rows' state belongs to."""
    dim = int_arg(dim, "dim", minimum=1)
    key_bound = _key_bound(key_bound)
    schema = C.TableSchema()
    schema.dim = dim
    schema.init = init_spec(init, init_bound, init_value, seed, key_bound)
    schema.key_bound = -1 if key_bound is None else key_bound
    schema.optimizer = optimizer_spec(optimizer)
    return schema


# ---- shards and servers ----------------------------------------------------------------------
def ps_shard_options(
    shard_id: int = 0,
    num_shards: int = 1,
    *,
    dim: int | None = None,
    store_threads: int = 1,
    store_shards: int = 16,
    memory_budget: int | str | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    high_watermark: float = 0.8,
    low_watermark: float = 0.6,
    page_rows: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> PSShardOptions:
    """A `PSShard`'s options; arguments as `PSShard`."""
    shard_id = int_arg(shard_id, "shard_id", minimum=0)
    num_shards = int_arg(num_shards, "num_shards", minimum=1)
    if shard_id >= num_shards:
        raise ValueError(f"shard_id {shard_id} must be below num_shards {num_shards}")
    s = C.ShardOptions()
    s.shard_id = shard_id
    s.num_shards = num_shards
    s.expected_dim = 0 if dim is None else int_arg(dim, "dim", minimum=1)
    s.checkpoint_every = int_arg(checkpoint_every, "checkpoint_every", minimum=0)
    s.checkpoint_dir = optional_path(checkpoint_dir, "checkpoint_dir")
    if s.checkpoint_every and not s.checkpoint_dir:
        raise ValueError("checkpoint_every needs a checkpoint_dir")
    s.max_frame_bytes = int_arg(max_frame_bytes, "max_frame_bytes", minimum=4096)
    store = _table_store(store_shards, store_threads, memory_budget, spill_dir, high_watermark,
                         low_watermark, page_rows)
    return PSShardOptions(s, store)


def _server_options(host: Any, port: Any, job_token: Any, allow_no_token: Any,
                    handshake_timeout: Any, max_connections: Any, max_unauthenticated: Any,
                    max_unauthenticated_per_host: Any, io_threads: Any, target: Any) -> Any:
    if not isinstance(host, str) or not host:
        raise TypeError("host must be a non-empty str")
    port = int_arg(port, "port", minimum=0)
    if port > 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if not isinstance(job_token, str):
        raise TypeError("job_token must be a str")
    if not isinstance(allow_no_token, bool):
        raise TypeError("allow_no_token must be a bool")
    handshake_timeout = float_arg(handshake_timeout, "handshake_timeout")
    if not handshake_timeout > 0:
        raise ValueError(f"handshake_timeout must be > 0, got {handshake_timeout}")
    target.host = host
    target.port = port
    target.job_token = job_token
    target.allow_no_token = allow_no_token
    target.handshake_timeout = handshake_timeout
    target.max_connections = int_arg(max_connections, "max_connections", minimum=1)
    target.max_unauthenticated = int_arg(max_unauthenticated, "max_unauthenticated", minimum=1)
    target.max_unauthenticated_per_host = int_arg(
        max_unauthenticated_per_host, "max_unauthenticated_per_host", minimum=1)
    io_threads = int_arg(io_threads, "io_threads", minimum=1)
    if io_threads > 64:
        raise ValueError(f"io_threads must be in [1, 64], got {io_threads}")
    target.io_threads = io_threads
    return target


def tcp_server_options(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    job_token: str = "",
    allow_no_token: bool = False,
    handshake_timeout: float = 10.0,
    idle_timeout: float = 300.0,
    max_connections: int = 1024,
    max_unauthenticated: int = 256,
    max_unauthenticated_per_host: int = 32,
    io_threads: int = 4,
) -> Any:
    """A TCP shard server's options (a ``C.TcpServerOptions``; csrc/server/tcp_server.h).

    `handshake_timeout`: seconds from accept to a completed Hello (an absolute deadline).
    `idle_timeout`: seconds an authenticated connection may send nothing (clients send
    keep-alives every 30 s; 0: no limit). At most `max_unauthenticated` connections (and
    `max_unauthenticated_per_host` from one address) may not have authenticated yet: a new
    one sheds the oldest. `io_threads` loop threads serve every connection. An empty
    `job_token` on a non-loopback `host` is refused unless `allow_no_token`.
    """
    o = _server_options(host, port, job_token, allow_no_token, handshake_timeout,
                        max_connections, max_unauthenticated, max_unauthenticated_per_host,
                        io_threads, C.TcpServerOptions())
    idle_timeout = float_arg(idle_timeout, "idle_timeout")
    if not idle_timeout >= 0:
        raise ValueError(f"idle_timeout must be >= 0 (0: no limit), got {idle_timeout}")
    o.idle_timeout = idle_timeout
    return o


def ucx_server_options(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    job_token: str = "",
    allow_no_token: bool = False,
    ucx_tls: str | None = None,
    ucx_devices: str | None = None,
    handshake_timeout: float = 10.0,
    max_connections: int = 1024,
    max_unauthenticated: int = 256,
    max_unauthenticated_per_host: int = 32,
    io_threads: int = 2,
    progress_threads: int = 2,
) -> Any:
    """A UCX shard server's options (a ``C.UcxServerOptions``; REQUIRES: a build with UCX).
    `ucx_tls` / `ucx_devices` override ``UCX_TLS`` / ``UCX_NET_DEVICES`` for this server; the
    other arguments are `tcp_server_options`' (for the bootstrap connections;
    `io_threads` loop threads run the bootstraps); `progress_threads` threads drive every
    established connection (csrc/transport/ucx_progress.h)."""
    for name, value in (("ucx_tls", ucx_tls or ""), ("ucx_devices", ucx_devices or "")):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str")
    o = _server_options(host, port, job_token, allow_no_token, handshake_timeout,
                        max_connections, max_unauthenticated, max_unauthenticated_per_host,
                        io_threads, C.UcxServerOptions())
    o.ucx_tls = ucx_tls or ""
    o.ucx_devices = ucx_devices or ""
    progress_threads = int_arg(progress_threads, "progress_threads", minimum=1)
    if progress_threads > 64:
        raise ValueError(f"progress_threads must be in [1, 64], got {progress_threads}")
    o.progress_threads = progress_threads
    return o


# ---- clients -----------------------------------------------------------------------------------
def ps_client_options(
    *,
    table: str,
    dim: int,
    lr: float,
    rank: int = 0,
    world_size: int = 1,
    gradient_division: bool = True,
    partitioner: str = "modulo",
    job_token: str = "",
    session_id: int | None = None,
    max_packet_rows: int = 4096,
    inflight_packets: int = 8,
    timeout: float = 120.0,
    connect_timeout: float = 30.0,
    init: str = "uniform",
    init_bound: float | Sequence[tuple[int, float]] | None = None,
    init_value: float = 0.0,
    seed: int = 0,
    key_bound: int | None = None,
    optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
) -> PSClientOptions:
    """A `PSClient`'s options; arguments as `PSClient` (`partitioner`: its kind)."""
    if not isinstance(table, str):
        raise TypeError(f"table must be a str, got {type(table).__name__}")
    c = C.ClientOptions()
    c.table = table
    c.dim = int_arg(dim, "dim", minimum=1)
    c.lr = lr_arg(lr, "lr")
    c.optimizer = optimizer_spec(optimizer)
    world_size = int_arg(world_size, "world_size", minimum=1)
    rank = int_arg(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank {rank} must be below world_size {world_size}")
    c.rank = rank
    c.world_size = world_size
    if partitioner not in PARTITIONERS:
        raise ValueError(f"partitioner must be one of {list(PARTITIONERS)}, got {partitioner!r}")
    c.partition = partitioner
    if not isinstance(job_token, str):
        raise TypeError("job_token must be a str")
    if session_id is None:
        session_id = default_session_id(job_token, table)
    session_id = int_arg(session_id, "session_id", minimum=0)
    if session_id >= 1 << 64:
        raise ValueError("session_id must fit in 64 bits")
    c.session = session_id
    c.grad_division = bool(gradient_division)
    key_bound = _key_bound(key_bound)
    c.init = init_spec(init, init_bound, init_value, seed, key_bound)
    c.key_bound = -1 if key_bound is None else key_bound
    c.timeout = float_arg(timeout, "timeout")
    if c.timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {c.timeout}")
    c.max_packet_rows = int_arg(max_packet_rows, "max_packet_rows", minimum=1)
    c.inflight_packets = int_arg(inflight_packets, "inflight_packets", minimum=1)
    connect = C.ConnectOptions()
    connect.job_token = job_token
    connect.connect_timeout = float_arg(connect_timeout, "connect_timeout")
    return PSClientOptions(c, connect)


# ---- from a BagPipeConfig (the one place) ------------------------------------------------------
def client_options(
    config: BagPipeConfig,
    *,
    table: str,
    dim: int,
    lr: float,
    rank: int,
    world_size: int,
    job_token: str | None = None,
    session_id: int | None = None,
    init: str = "uniform",
    init_bound: float | Sequence[tuple[int, float]] | None = None,
    init_value: float = 0.0,
    key_bound: int | None = None,
    optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
) -> PSClientOptions:
    """The options of one rank's client of table `table` under `config`: its gradient
    division, partitioner, packet rows, window, timeouts, job token (unless `job_token`, the
    job's agreed one, is given) and init seed; the table's own facts (dim, lr, init, key
    bound, optimizer) are arguments."""
    return ps_client_options(
        table=table,
        dim=dim,
        lr=lr,
        rank=rank,
        world_size=world_size,
        gradient_division=config.resolved_gradient_division(),
        partitioner=config.partitioner,
        job_token=(config.job_token or "") if job_token is None else job_token,
        session_id=session_id,
        max_packet_rows=config.max_packet_rows,
        inflight_packets=config.inflight_packets,
        timeout=config.ps_timeout,
        connect_timeout=config.connect_timeout,
        init=init,
        init_bound=init_bound,
        init_value=init_value,
        seed=config.init_seed,
        key_bound=key_bound,
        optimizer=optimizer,
    )


def shard_options(
    config: BagPipeConfig, shard_id: int, num_shards: int, **server_only: Any
) -> PSShardOptions:
    """The options of shard `shard_id` of `num_shards` under `config` (its store threads,
    memory budget and spill directory); `server_only` are `ps_shard_options` arguments no
    config field holds (dim, store_shards, page_rows, checkpoints, max_frame_bytes)."""
    return ps_shard_options(
        shard_id,
        num_shards,
        store_threads=config.store_threads,
        memory_budget=config.memory_budget,
        spill_dir=config.spill_dir,
        **server_only,
    )
