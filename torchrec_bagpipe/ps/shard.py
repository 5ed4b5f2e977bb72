"""PS shards in this process, their TCP servers, and shard server processes.

A `PSShard` hosts named tables (one native EmbeddingStore plus one commit coordinator each;
dims may differ). It is reached in-process by a `PSClient` listing the shard object itself
(the local transport: no sockets), and by other processes once `serve()` runs a TCP server for
it on background native threads. `spawn_server` starts the standalone `torchrec-bagpipe-ps`
program instead (one shard per process).
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
from torchrec_bagpipe.ps._args import int_arg, keys_arg, optional_path, rows_arg
from torchrec_bagpipe.ps.native_server import NativeServer
from torchrec_bagpipe.ps.optimizers import OptimizerSpec
from torchrec_bagpipe.ps.options import (
    DEFAULT_MAX_FRAME_BYTES,
    PSShardOptions,
    ps_shard_options,
    table_schema,
    tcp_server_options,
)
from torchrec_bagpipe.ps.rdma import UcxShardServer, serve_ucx

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
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

    Store options (``store_threads``, ``store_shards``, ``memory_budget``, ``spill_dir``,
    watermarks, ``page_rows``) apply to every table the shard creates. ``dim``, when given,
    is the only row width this shard accepts. With ``checkpoint_dir`` each table checkpoints
    itself every ``checkpoint_every`` committed steps (0: only on request), and
    ``restore=True`` first loads the tables found there (``restore`` may also name another
    directory).
    """

    def __init__(
        self,
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
        restore: bool | str | os.PathLike[str] = False,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        verbose: bool = False,
    ) -> None:
        self._open(
            ps_shard_options(
                shard_id,
                num_shards,
                dim=dim,
                store_threads=store_threads,
                store_shards=store_shards,
                memory_budget=memory_budget,
                spill_dir=spill_dir,
                high_watermark=high_watermark,
                low_watermark=low_watermark,
                page_rows=page_rows,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=checkpoint_every,
                max_frame_bytes=max_frame_bytes,
            ),
            restore=restore,
            verbose=verbose,
        )

    @classmethod
    def from_options(
        cls,
        options: PSShardOptions,
        *,
        restore: bool | str | os.PathLike[str] = False,
        verbose: bool = False,
    ) -> PSShard:
        """A shard built from its options (`torchrec_bagpipe.ps.options.ps_shard_options`,
        or `shard_options(config, ...)`); `restore` and `verbose` as the constructor."""
        shard = cls.__new__(cls)
        shard._open(options, restore=restore, verbose=verbose)
        return shard

    def _open(
        self, options: PSShardOptions, *, restore: bool | str | os.PathLike[str], verbose: bool
    ) -> None:
        self._core = C.PSShardCore(options.shard, options.store, bool(verbose))
        ckpt = str(options.shard.checkpoint_dir)
        self.checkpoint_dir = ckpt or None
        self._servers: list[NativeServer] = []
        self.restored: dict[str, int] = {}
        if restore is True:
            if not ckpt:
                raise ValueError("restore=True needs a checkpoint_dir")
            if os.path.isdir(ckpt):
                self.restored = dict(self._core.restore(ckpt))
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
    def create_table(
        self,
        name: str,
        dim: int,
        *,
        init: str = "uniform",
        init_bound: float | Sequence[tuple[int, float]] | None = None,
        init_value: float = 0.0,
        seed: int = 0,
        key_bound: int | None = None,
        optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
    ) -> None:
        """Creates table `name` whose rows `optimizer` updates (a matching existing table is
        fine; a different one is a ValueError naming the table and the field). A client's
        session open creates it on demand too."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        schema = table_schema(dim, init=init, init_bound=init_bound, init_value=init_value,
                              seed=seed, key_bound=key_bound, optimizer=optimizer)
        self._core.create_table(name, schema)

    def table_optimizer(self, table: str) -> OptimizerSpec:
        """The optimizer whose state the table's rows hold."""
        o = self._core.table_schema(table).optimizer
        return OptimizerSpec(kind=o.kind, eps=o.eps, beta1=o.beta1, beta2=o.beta2,
                             weight_decay=o.weight_decay,
                             initial_accumulator_value=o.initial_accumulator_value)

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
    def serve(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> ShardServer:
        """Serves this shard over TCP on background native threads (port 0: any free port;
        see `ShardServer.port`). Only 127.0.0.1 unless told otherwise. `options` are
        `torchrec_bagpipe.ps.options.tcp_server_options`' keyword arguments (``job_token``,
        ``allow_no_token``, ``handshake_timeout``, ``idle_timeout``, ``max_connections``,
        ``max_unauthenticated``, ``max_unauthenticated_per_host``, ``io_threads``)."""
        core = self._core.serve(tcp_server_options(host, port, **options))
        server = ShardServer(core, self)
        self._servers.append(server)
        return server

    def serve_ucx(self, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> UcxShardServer:
        """Serves this shard over the rdma (UCX) transport (`torchrec_bagpipe.ps.rdma.serve_ucx`
        takes the keyword arguments); clients use the returned server's ``address``."""
        server = serve_ucx(self, host, port, **kwargs)
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


def start_local_shards(num_shards: int = 1, **shard_kwargs: Any) -> list[PSShard]:
    """`num_shards` in-process shards (pass them to `PSClient` as endpoints)."""
    num_shards = int_arg(num_shards, "num_shards", minimum=1)
    return [PSShard(i, num_shards, **shard_kwargs) for i in range(num_shards)]


def start_tcp_shard(
    shard_id: int = 0,
    num_shards: int = 1,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    job_token: str = "",
    **shard_kwargs: Any,
) -> tuple[PSShard, ShardServer]:
    """An in-process shard served over TCP (how a trainer hosts its shard for other ranks)."""
    shard = PSShard(shard_id, num_shards, **shard_kwargs)
    return shard, shard.serve(host, port, job_token=job_token)


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
