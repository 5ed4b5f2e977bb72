"""Runs `examples/dlrm/dlrm_main.py`'s `main` on W spawned CPU ranks (gloo) and collects
every rank's results; shared by the DLRM benchmarks. Every wait is bounded."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["REPO", "run_dlrm"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, argv: list[str], kwargs: dict[str, Any],
               out: Any) -> None:
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    # The example prints its plan and metrics table; the benchmarks' stdout carries only
    # JSON lines, so the ranks' output goes to stderr.
    sys.stdout = sys.stderr
    try:
        import torch

        torch.set_num_threads(1)
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


def run_dlrm(argv: list[str], world: int, timeout: float, **kwargs: Any) -> list[dict[str, Any]]:
    """`dlrm_main.main(argv, **kwargs)` on `world` ranks; every rank's results, in rank
    order. Raises RankError for the first rank that failed, TimeoutError after `timeout`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, argv, kwargs, out),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(world):
            try:
                rank, status, value = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{argv}: no result within {timeout}s") from None
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
