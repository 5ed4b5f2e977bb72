"""Runs a function on W gloo ranks in spawned processes and collects the results.

Every wait is bounded: a rank that hangs or dies fails the test with its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(fn: Callable[..., Any], rank: int, world_size: int, init_file: str,
           results: Any, args: tuple[Any, ...], env: dict[str, str]) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        # The parent imported torch before OMP_NUM_THREADS reached this process.
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))

        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            try:
                from torchrec_bagpipe.distributed import close_job

                close_job()
            finally:
                dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # report everything, including SystemExit from a helper
        results.put((rank, "error", traceback.format_exc()))


def run_world(fn: Callable[..., Any], world_size: int = 2, args: tuple[Any, ...] = (),
              timeout: float = 240.0, env: dict[str, str] | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, init_file, results, args, env),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            while len(out) + len(errors) < world_size:
                try:
                    rank, status, value = results.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"run_world: ranks {sorted(set(range(world_size)) - set(out))} did not "
                        f"finish within {timeout}s"
                    ) from None
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    break
        finally:
            for p in procs:
                p.join(timeout=10 if not errors else 2)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
        return [out[r] for r in range(world_size)]
