"""PS shards in this process, their TCP servers, and shard server processes.

A `PSShard` (a `ShardSpec`) hosts named tables (one native EmbeddingStore plus one commit
coordinator each; dims may differ). It is reached in-process by a `PSClient` listing the
shard object itself (the local transport: no sockets), and by other processes once `serve()`
runs a TCP server for it (a `TcpServerSpec`) on background native threads. `spawn_server`
starts the standalone `torchrec-bagpipe-ps` program instead (one shard per process).
"""

from __future__ import annotations

import contextlib
import numbers
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

import torch

from torchrec_bagpipe._native import C
from torchrec_bagpipe.ps._args import int_arg, optional_path, spec_arg
from torchrec_bagpipe.ps._tensor_args import keys_arg, rows_arg
from torchrec_bagpipe.ps.native_server import NativeServer
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.ps.rdma import UcxShardServer, serve_ucx
from torchrec_bagpipe.ps.shard_specs import ShardSpec, TcpServerSpec, UcxServerSpec
from torchrec_bagpipe.ps.table_specs import TableSchema

__all__ = [
    "PSShard",
    "ServerProcess",
    "ShardServer",
    "spawn_server",
    "start_local_shards",
    "start_tcp_shard",
]

LISTEN_RE = re.compile(r"^listening (\S+):(\d+) shard (\d+)/(\d+)")


class ShardServer(NativeServer):
    """A TCP server for one `PSShard`, running on background native threads."""


class PSShard:
    """One parameter-server shard: named tables, each a store plus a commit coordinator.

    Built from a `ShardSpec` (or its fields as keywords: ``PSShard(shard_id=0,
    num_shards=2, dim=16)``; with a spec they replace its fields): its store layout applies
    to every table the shard creates; `dim`, when given, is the only row width it accepts;
    with a `checkpoint_dir` each table checkpoints itself every `checkpoint_every` committed
    steps (0: only on request). ``restore=True`` first loads the tables found in the
    checkpoint directory (`restore` may also name another directory); `verbose` logs one
    line per session event to stderr.

    Resharding: `restore` given as a list of directories is a whole checkpoint set written
    by another number of shards (one directory per old shard, any order); this shard keeps
    the stored rows that `partitioner` (the clients' `ClientSpec.partitioner`) routes to it,
    weights and optimizer state bitwise, so a set of K shards restores onto K' shards.
    """

    def __init__(
        self,
        spec: ShardSpec | None = None,
        /,
        *,
        restore: bool | str | os.PathLike[str] | Sequence[str | os.PathLike[str]] = False,
        partitioner: str = "modulo",
        verbose: bool = False,
        **fields: Any,
    ) -> None:
        spec = spec_arg(ShardSpec, spec, fields, "PSShard")
        self.spec = spec
        self._core = C.PSShardCore(spec.native(), spec.store.native(), bool(verbose))
        ckpt = spec.checkpoint_dir
        self.checkpoint_dir = ckpt
        self._servers: list[NativeServer] = []
        self.restored: dict[str, int] = {}
        if restore is True:
            if not ckpt:
                raise ValueError("restore=True needs a checkpoint_dir")
            if os.path.isdir(ckpt):
                self.restored = dict(self._core.restore(ckpt))
        elif isinstance(restore, (list, tuple)):
            dirs = [optional_path(d, "restore") for d in restore]
            self.restored = dict(self._core.restore_resharded(dirs, str(partitioner)))
        elif restore is not False and restore is not None:
            self.restored = dict(self._core.restore(optional_path(restore, "restore")))

    # ---- identity ------------------------------------------------------------------------
    @property
    def shard_id(self) -> int:
        return int(self._core.shard_id)

    @property
    def num_shards(self) -> int:
        return int(self._core.num_shards)

    @property
    def core(self) -> Any:
        """The native shard (what `PSClient` endpoints resolve to for the local transport)."""
        return self._core

    def __repr__(self) -> str:
        return f"PSShard({self.shard_id}/{self.num_shards}, tables={self.tables()})"

    # ---- tables --------------------------------------------------------------------------
    def create_table(self, name: str, schema: TableSchema | None = None, /,
                     **fields: Any) -> None:
        """Creates table `name` of `schema` (a `TableSchema`, or its fields as keywords: dim,
        init, init_bound, init_value, seed, key_bound, optimizer). A matching existing table
        is fine; a different one is a ValueError naming the table and the field. A client's
        session open creates it on demand too."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        schema = spec_arg(TableSchema, schema, fields, "create_table")
        self._core.create_table(name, schema.native())

    def table_optimizer(self, table: str) -> OptimizerSpec:
        """The optimizer whose state the table's rows hold."""
        return OptimizerSpec.from_native(self._core.table_schema(table).optimizer)

    def _width(self, table: str, with_state: bool) -> int:
        schema = self._core.table_schema(table)
        dim = int(schema.dim)
        return dim + (OptimizerSpec(kind=schema.optimizer.kind).state_dim(dim) if with_state else 0)

    def tables(self) -> list[str]:
        return list(self._core.tables())

    def committed_step(self, table: str) -> int:
        """The table's committed step (-1 before the first commit)."""
        return int(self._core.committed_step(table))

    def lookup(self, table: str, keys: torch.Tensor, *, with_state: bool = False) -> torch.Tensor:
        """Rows of `keys` at the table's current committed step (a pure read); with their
        optimizer state after the weights (dim + state_dim columns) when `with_state`."""
        k = keys_arg(keys)
        with_state = bool(with_state)
        out = torch.empty((k.shape[0], self._width(table, with_state)), dtype=torch.float32)
        self._core.read(table, k, out.numpy(), with_state)
        return out

    def get(
        self, table: str, keys: torch.Tensor, at_step: int, timeout: float = 120.0, *,
        with_state: bool = False,
    ) -> torch.Tensor:
        """Rows of `keys` once the table committed `at_step` (TimeoutError after `timeout`);
        `with_state` as `lookup`."""
        k = keys_arg(keys)
        at_step = int_arg(at_step, "at_step", minimum=-1)
        with_state = bool(with_state)
        out = torch.empty((k.shape[0], self._width(table, with_state)), dtype=torch.float32)
        self._core.read_at(table, at_step, k, out.numpy(), float(timeout), with_state)
        return out

    def assign(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *,
               with_state: bool = False) -> None:
        """Bulk load (outside the step protocol); the last duplicate wins. `rows` are dim
        wide (stored rows keep their optimizer state), or dim + state_dim with their state
        when `with_state`."""
        k = keys_arg(keys)
        with_state = bool(with_state)
        width = self._width(table, with_state)
        self._core.assign(table, k, rows_arg(rows, "rows", k.shape[0], width), with_state)

    # ---- checkpoints ---------------------------------------------------------------------
    def checkpoint(self, directory: str | os.PathLike[str] | None = None) -> dict[str, int]:
        """Checkpoints every table at its committed step into `directory` (default: the
        shard's checkpoint_dir); returns table -> step saved."""
        return dict(self._core.checkpoint(optional_path(directory, "directory")))

    # ---- serving -------------------------------------------------------------------------
    def serve(self, spec: TcpServerSpec | None = None, /, **fields: Any) -> ShardServer:
        """Serves this shard over TCP on background native threads, as `spec` says (a
        `TcpServerSpec`, or its fields as keywords: host, port (0: any free port; see
        `ShardServer.port`), job_token, allow_no_token, handshake_timeout, idle_timeout,
        max_connections, max_unauthenticated, max_unauthenticated_per_host, io_threads).
        Only 127.0.0.1 unless told otherwise."""
        spec = spec_arg(TcpServerSpec, spec, fields, "serve")
        server = ShardServer(self._core.serve(spec.native()), self)
        self._servers.append(server)
        return server

    def serve_ucx(self, spec: UcxServerSpec | None = None, /, **fields: Any) -> UcxShardServer:
        """Serves this shard over the rdma (UCX) transport (`torchrec_bagpipe.ps.rdma.serve_ucx`:
        a `UcxServerSpec` or its fields); clients use the returned server's ``address``."""
        server = serve_ucx(self, spec, **fields)
        self._servers.append(server)
        return server

    # ---- stats and shutdown -----------------------------------------------------------------
    def table_stats(self, table: str) -> dict[str, Any]:
        """Coordinator counters (committed_step, steps_applied, chunks_received, ...) plus the
        store's (under "store")."""
        return dict(self._core.table_stats(table))

    def stats(self) -> dict[str, int]:
        """frames, rejected, unauthorized."""
        return dict(self._core.stats())

    def begin_shutdown(self, why: str) -> None:
        """Starts draining: every attached client is told (it fails with a
        `torchrec_bagpipe.ShuttingDownError` naming this shard and `why`), new work is refused,
        closing sessions still works. Idempotent."""
        if not isinstance(why, str):
            raise TypeError("why must be a str")
        self._core.begin_shutdown(why)

    def close(self, drain_timeout: float = 0.0) -> None:
        """Drains (clients are told, new work is refused), stops this shard's servers (waiting
        up to `drain_timeout` s for clients to disconnect). In-process clients should be
        closed first."""
        self._core.begin_shutdown("closed")
        for s in self._servers:
            s.stop(drain_timeout)
        self._servers.clear()

    def __enter__(self) -> PSShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_local_shards(num_shards: int = 1, **fields: Any) -> list[PSShard]:
    """`num_shards` in-process shards (pass them to `PSClient` as endpoints); `fields`: the
    other `ShardSpec` fields, the same for each."""
    num_shards = int_arg(num_shards, "num_shards", minimum=1)
    return [PSShard(shard_id=i, num_shards=num_shards, **fields) for i in range(num_shards)]


def start_tcp_shard(shard: ShardSpec | None = None,
                    server: TcpServerSpec | None = None) -> tuple[PSShard, ShardServer]:
    """An in-process shard served over TCP (how a trainer hosts its shard for other ranks)."""
    ps_shard = PSShard(shard)
    return ps_shard, ps_shard.serve(server)


class ServerProcess:
    """A `torchrec-bagpipe-ps` child process (see `spawn_server`)."""

    def __init__(self, proc: subprocess.Popen[str], shard_id: int, startup_timeout: float) -> None:
        self.proc = proc
        self.shard_id = shard_id
        self.host = ""
        self.port = 0
        self.stdout_lines: list[str] = []
        self._listening = threading.Event()
        # Keep draining stdout so the child never blocks on a full pipe.
        self._pump = threading.Thread(target=self._drain, daemon=True)
        self._pump.start()
        if not self._listening.wait(startup_timeout):
            self.kill()
            raise TimeoutError(
                f"PS server shard {shard_id} did not start within {startup_timeout} s"
            )
        if not self.port:
            code = proc.wait(30)
            raise RuntimeError(
                f"PS server shard {shard_id} exited with code {code} before listening: "
                + " | ".join(self.stdout_lines[-5:])
            )

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = LISTEN_RE.match(line.strip())
            if m and not self.port:
                self.host, self.port = m.group(1), int(m.group(2))
                self._listening.set()
            elif len(self.stdout_lines) < 100:
                self.stdout_lines.append(line.rstrip())
        self._listening.set()  # EOF: the child is gone

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server drains and exits 0); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the shard dies at once (used to test failure handling)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.terminate(30)
        if self.proc.poll() is None:
            self.kill()


def spawn_server(
    shard_id: int = 0,
    num_shards: int = 1,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    job_token: str | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    stderr: IO[Any] | int | None = None,
    startup_timeout: float = 120.0,
) -> ServerProcess:
    """Starts ``python -m torchrec_bagpipe.ps.server`` and waits for its listening line.

    `args` are extra command-line flags (``--dim``, ``--checkpoint-dir`` ...). The job token
    travels in the environment (``BAGPIPE_JOB_TOKEN``), not on the command line.
    """
    shard_id = int_arg(shard_id, "shard_id", minimum=0)
    num_shards = int_arg(num_shards, "num_shards", minimum=1)
    if not isinstance(port, numbers.Integral):
        raise TypeError("port must be an int")
    child_env = dict(os.environ if env is None else env)
    if job_token is not None:
        child_env["BAGPIPE_JOB_TOKEN"] = job_token
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo_root, child_env.get("PYTHONPATH", "")) if p
    )
    cmd = [
        sys.executable, "-m", "torchrec_bagpipe.ps.server",
        "--shard-id", str(shard_id), "--num-shards", str(num_shards),
        "--host", host, "--port", str(int(port)), *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=stderr, env=child_env, text=True, bufsize=1
    )
    return ServerProcess(proc, shard_id, float(startup_timeout))
