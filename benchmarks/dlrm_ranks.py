"""Runs `examples/dlrm/dlrm_main.py`'s `main` on W spawned CPU ranks (gloo) and collects
every rank's results, and starts PS shard servers as separate processes for runs with
``--ps-type tcp``; shared by the DLRM benchmarks. Every wait is bounded."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import TracebackType
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["REPO", "PSServers", "free_port", "run_dlrm"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, argv: list[str], kwargs: dict[str, Any],
               out: Any, env: dict[str, str] | None = None) -> None:
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        **(env or {}),
    })
    # The example prints its plan and metrics table; the benchmarks' stdout carries only
    # JSON lines, so the ranks' output goes to stderr.
    sys.stdout = sys.stderr
    try:
        import torch

        torch.set_num_threads(1)
        # This checkout's package, not whichever one the interpreter has installed (the PS
        # server processes get the same through PYTHONPATH): both ends speak one protocol.
        sys.path.insert(0, REPO)
        sys.path.insert(0, os.path.join(REPO, "examples", "dlrm"))
        import dlrm_main
        import torch.distributed as dist

        results = dlrm_main.main(argv, **kwargs)
        if dist.is_initialized():
            dist.destroy_process_group()
        out.put((rank, "ok", results))
    except BaseException as e:  # report everything, the exception's type included
        import traceback

        out.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


class RankError(RuntimeError):
    """A rank failed: `kind` and `message` are its exception's type name and message."""

    def __init__(self, rank: int, kind: str, message: str, trace: str) -> None:
        super().__init__(f"rank {rank} failed with {kind}: {message}\n{trace}")
        self.kind = kind
        self.message = message


def run_dlrm(argv: list[str], world: int, timeout: float, *,
             env: dict[str, str] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """`dlrm_main.main(argv, **kwargs)` on `world` ranks, with `env` added to each rank's
    environment (e.g. ``GLOO_SOCKET_IFNAME``); every rank's results, in rank order. Raises
    RankError for the first rank that failed, TimeoutError after `timeout`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, argv, kwargs, out, env),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{argv}: no result within {timeout}s")
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                # A rank that died without a word (a crash, a failed spawn) ends the wait.
                dead = [r for r, p in enumerate(procs)
                        if r not in results and p.exitcode is not None]
                if dead and out.empty():
                    r = dead[0]
                    raise RankError(r, "exit", f"rank {r} exited with code "
                                    f"{procs[r].exitcode} without a result", "") from None
                continue
            if status != "ok":
                raise RankError(rank, *value)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world)]


def _die_with_parent() -> None:
    """In a server child before exec: SIGTERM it when the benchmark process dies (Linux), so
    no server outlives a killed benchmark."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_LISTENING = re.compile(r"^listening (\S+):(\d+) shard \d+/\d+")


class PSServers:
    """Context manager: one PS shard server process (``python -m torchrec_bagpipe.ps.server``)
    per port, shard i on ports[i], all on 127.0.0.1 with job token `token`; `addresses` are
    what trainers pass as ``--ps-addresses``. The servers start fresh (a shard keeps its
    tables' committed steps, so a new training run needs new servers) and are stopped on exit:
    SIGTERM (drain), then SIGKILL after `stop_timeout` seconds."""

    def __init__(self, ports: list[int], token: str, *, startup_timeout: float = 60.0,
                 stop_timeout: float = 30.0, extra_args: list[str] | None = None) -> None:
        self.ports = list(ports)
        self.token = token
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = list(extra_args or [])
        self.procs: list[subprocess.Popen[str]] = []

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def __enter__(self) -> PSServers:
        try:
            for i, port in enumerate(self.ports):
                cmd = [sys.executable, "-m", "torchrec_bagpipe.ps.server", "--shard-id", str(i),
                       "--num-shards", str(len(self.ports)), "--host", "127.0.0.1",
                       "--port", str(port), "--quiet", *self.extra_args]
                env = {**os.environ, "BAGPIPE_JOB_TOKEN": self.token,
                       "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                   stderr=sys.stderr, text=True,
                                                   preexec_fn=_die_with_parent))
            for i, proc in enumerate(self.procs):
                self._await_listening(i, proc)
        except BaseException:
            self._stop()
            raise
        return self

    def _await_listening(self, i: int, proc: subprocess.Popen[str]) -> None:
        found = threading.Event()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if _LISTENING.match(line):
                    found.set()
            # the rest of stdout is drained here until the server exits

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(self.startup_timeout):
            raise TimeoutError(f"PS shard {i} (port {self.ports[i]}) did not listen within "
                               f"{self.startup_timeout}s (status {proc.poll()})")

    def _stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()
