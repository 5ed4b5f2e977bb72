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
from torchrec_bagpipe.ps.store import _budget_arg, _init_args, _int_arg, _keys_arg, _rows_arg

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PSShard",
    "ServerProcess",
    "ShardServer",
    "spawn_server",
    "start_local_shards",
    "start_tcp_shard",
]

DEFAULT_MAX_FRAME_BYTES = 256 << 20
LISTEN_RE = re.compile(r"^listening (\S+):(\d+) shard (\d+)/(\d+)")


def _path_or_empty(value: Any, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path, got {type(value).__name__}")
    return os.fspath(value)


class _NativeServer:
    """A shard server (TCP or UCX) running on background native threads; `_core` is its
    native handle (host, port, stopped, stop(drain_timeout), stats())."""

    _scheme = ""  # the endpoint prefix clients use for this transport

    def __init__(self, core: Any, shard: PSShard) -> None:
        self._core = core
        self.shard = shard

    @property
    def host(self) -> str:
        return str(self._core.host)

    @property
    def port(self) -> int:
        return int(self._core.port)

    @property
    def address(self) -> str:
        """The `PSClient` endpoint of this server (IPv6 hosts bracketed)."""
        host = self.host
        port = self.port
        return self._scheme + (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    @property
    def stopped(self) -> bool:
        return bool(self._core.stopped)

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Stops accepting, waits up to `drain_timeout` s for clients to disconnect, then
        closes the remaining connections (their ranks leave their sessions)."""
        self._core.stop(float(drain_timeout))

    def stats(self) -> dict[str, int]:
        """accepted, refused, active, frames, bytes_in, bytes_out, closed_by_server."""
        return dict(self._core.stats())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.address}, "
                f"shard={self.shard.shard_id}/{self.shard.num_shards})")


class ShardServer(_NativeServer):
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
        shard_id = _int_arg(shard_id, "shard_id", minimum=0)
        num_shards = _int_arg(num_shards, "num_shards", minimum=1)
        if shard_id >= num_shards:
            raise ValueError(f"shard_id {shard_id} must be below num_shards {num_shards}")
        expected_dim = 0 if dim is None else _int_arg(dim, "dim", minimum=1)
        checkpoint_every = _int_arg(checkpoint_every, "checkpoint_every", minimum=0)
        ckpt = _path_or_empty(checkpoint_dir, "checkpoint_dir")
        if checkpoint_every and not ckpt:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        self._core = C.PSShardCore(
            shard_id,
            num_shards,
            expected_dim,
            ckpt,
            checkpoint_every,
            _int_arg(max_frame_bytes, "max_frame_bytes", minimum=4096),
            bool(verbose),
            _int_arg(store_shards, "store_shards", minimum=1),
            _int_arg(store_threads, "store_threads", minimum=1),
            _budget_arg(memory_budget),
            _path_or_empty(spill_dir, "spill_dir"),
            float(high_watermark),
            float(low_watermark),
            0 if page_rows is None else _int_arg(page_rows, "page_rows", minimum=1),
        )
        self.checkpoint_dir = ckpt or None
        self._servers: list[Any] = []  # ShardServer, UcxShardServer
        self.restored: dict[str, int] = {}
        if restore is True:
            if not ckpt:
                raise ValueError("restore=True needs a checkpoint_dir")
            if os.path.isdir(ckpt):
                self.restored = dict(self._core.restore(ckpt))
        elif restore is not False and restore is not None:
            self.restored = dict(self._core.restore(_path_or_empty(restore, "restore")))

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
    ) -> None:
        """Creates table `name` (a matching existing table is fine; a different one is a
        ValueError naming the field). A client's session open creates it on demand too."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        dim = _int_arg(dim, "dim", minimum=1)
        if key_bound is not None:
            key_bound = _int_arg(key_bound, "key_bound", minimum=1)
        kind, bound, value, seed, starts, bounds = _init_args(
            init, init_bound, init_value, seed, key_bound
        )
        self._core.create_table(
            name, dim, kind, bound, value, seed, starts, bounds,
            -1 if key_bound is None else key_bound,
        )

    def tables(self) -> list[str]:
        return list(self._core.tables())

    def committed_step(self, table: str) -> int:
        """The table's committed step (-1 before the first commit)."""
        return int(self._core.committed_step(table))

    def lookup(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """Rows of `keys` at the table's current committed step (a pure read)."""
        k = _keys_arg(keys)
        out = torch.empty((k.shape[0], int(self._core.table_dim(table))), dtype=torch.float32)
        self._core.read(table, k, out.numpy())
        return out

    def get(
        self, table: str, keys: torch.Tensor, at_step: int, timeout: float = 120.0
    ) -> torch.Tensor:
        """Rows of `keys` once the table committed `at_step` (TimeoutError after `timeout`)."""
        k = _keys_arg(keys)
        at_step = _int_arg(at_step, "at_step", minimum=-1)
        out = torch.empty((k.shape[0], int(self._core.table_dim(table))), dtype=torch.float32)
        self._core.read_at(table, at_step, k, out.numpy(), float(timeout))
        return out

    def assign(self, table: str, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Bulk load (outside the step protocol); the last duplicate wins."""
        k = _keys_arg(keys)
        dim = int(self._core.table_dim(table))
        self._core.assign(table, k, _rows_arg(rows, "rows", k.shape[0], dim))

    # ---- checkpoints ---------------------------------------------------------------------
    def checkpoint(self, directory: str | os.PathLike[str] | None = None) -> dict[str, int]:
        """Checkpoints every table at its committed step into `directory` (default: the
        shard's checkpoint_dir); returns table -> step saved."""
        return dict(self._core.checkpoint(_path_or_empty(directory, "directory")))

    # ---- serving -------------------------------------------------------------------------
    def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        job_token: str = "",
        handshake_timeout: float = 10.0,
        max_connections: int = 1024,
    ) -> ShardServer:
        """Serves this shard over TCP on background native threads (port 0: any free port;
        see `ShardServer.port`). Only 127.0.0.1 unless told otherwise."""
        if not isinstance(host, str) or not host:
            raise TypeError("host must be a non-empty str")
        port = _int_arg(port, "port", minimum=0)
        if port > 65535:
            raise ValueError(f"port must be <= 65535, got {port}")
        if not isinstance(job_token, str):
            raise TypeError("job_token must be a str")
        core = self._core.serve(
            host, port, job_token, float(handshake_timeout),
            _int_arg(max_connections, "max_connections", minimum=1),
        )
        server = ShardServer(core, self)
        self._servers.append(server)
        return server

    def serve_ucx(self, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> Any:
        """Serves this shard over the rdma (UCX) transport (`torchrec_bagpipe.ps.rdma.serve_ucx`
        takes the keyword arguments); clients use the returned server's ``address``."""
        from torchrec_bagpipe.ps.rdma import serve_ucx

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

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stops this shard's servers (draining up to `drain_timeout` s), then refuses new
        work. In-process clients should be closed first."""
        for s in self._servers:
            s.stop(drain_timeout)
        self._servers.clear()
        self._core.begin_shutdown("closed")

    def __enter__(self) -> PSShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_local_shards(num_shards: int = 1, **shard_kwargs: Any) -> list[PSShard]:
    """`num_shards` in-process shards (pass them to `PSClient` as endpoints)."""
    num_shards = _int_arg(num_shards, "num_shards", minimum=1)
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
    shard_id = _int_arg(shard_id, "shard_id", minimum=0)
    num_shards = _int_arg(num_shards, "num_shards", minimum=1)
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
