"""The controller's communication worker: one thread per `Collectives` instance.

Every collective a controller issues (ID exchanges, gradient all-reduces) and every commit
submission runs on this thread, in FIFO order. Controllers that share a `Collectives` object
(one per fused table) share the worker, so the order of collectives is the program order,
identical on every rank, whatever thread the caller uses. A task may wait (for a predecessor
commit), but only on work that every rank queued earlier, so the FIFO cannot deadlock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["CommWorker", "acquire_worker", "release_worker"]


class CommWorker:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.users = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


_lock = threading.Lock()
_workers: dict[int, tuple[object, CommWorker]] = {}


def acquire_worker(collectives: object) -> CommWorker:
    """The worker of `collectives` (created on first use); pair with `release_worker`."""
    with _lock:
        entry = _workers.get(id(collectives))
        if entry is None or entry[0] is not collectives:
            entry = (collectives, CommWorker(f"bagpipe-comm-r{getattr(collectives, 'rank', 0)}"))
            _workers[id(collectives)] = entry
        entry[1].users += 1
        return entry[1]


def release_worker(collectives: object) -> None:
    with _lock:
        entry = _workers.get(id(collectives))
        if entry is None or entry[0] is not collectives:
            return
        entry[1].users -= 1
        if entry[1].users > 0:
            return
        del _workers[id(collectives)]
    entry[1].shutdown()
