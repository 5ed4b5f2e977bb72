"""The controller's communication worker: one thread per `Collectives` instance.

Every collective a controller issues (ID exchanges, gradient all-reduces) and every commit
submission of collective aggregation runs on this thread, in FIFO order. Controllers that
share a `Collectives` object (one per fused table) share the worker, so the order of
collectives is the program order, identical on every rank, whatever thread the caller uses.

A controller submits through a `MeteredWorker`, its own handle on the shared worker, which
adds each task's run time to the controller's `runtime_worker_s` counter and the CPU time its
thread spent in it (`runtime_worker_cpu_s`: the rest of the run time is waiting, for peers in
a collective, for the PS, for a lock).

Thread safety: `acquire_worker` / `release_worker` may be called from any thread; the
registry of workers is guarded by `_lock`. `CommWorker.submit` and `MeteredWorker.submit`
may be called from any thread.

Invariants:
  1. One worker per live `Collectives` object (keyed by identity), created on first acquire,
     shut down (after its queued tasks) when the last user releases it.
  2. Tasks run one at a time in submission order. A task may wait (for a predecessor commit),
     but only on work that every rank queued earlier, so the FIFO cannot deadlock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from torchrec_bagpipe.runtime.metrics import RuntimeMetrics

__all__ = ["CommWorker", "MeteredWorker", "acquire_worker", "release_worker", "wait_task"]


def wait_task(future: Future, timeout: float, describe: Callable[[float], str]) -> Any:
    """``future.result(timeout)``, except that a wait that times out raises a TimeoutError
    whose message is ``describe(timeout)`` (naming the rank, the step and what was awaited,
    where a bare wait says nothing). The task's own result or error (a TimeoutError it
    raised included) comes back as is."""
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        if not future.done():
            raise TimeoutError(describe(timeout)) from None
    return future.result()  # done meanwhile, or its own TimeoutError


class CommWorker:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.users = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class MeteredWorker:
    """One controller's handle on a worker: each task's run time (on the worker thread,
    exceptions included) is added to `metrics.runtime_worker_s`, the thread's CPU time in it
    to `metrics.runtime_worker_cpu_s`."""

    def __init__(self, worker: CommWorker, metrics: RuntimeMetrics) -> None:
        self.worker = worker
        self._metrics = metrics

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.worker.submit(self._timed, fn, args)

    def _timed(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            self._metrics.add(runtime_worker_s=time.perf_counter() - t0,
                              runtime_worker_cpu_s=time.thread_time() - c0)


class _Registered(NamedTuple):
    collectives: object  # kept alive, so its id() is not reused while registered
    worker: CommWorker


_lock = threading.Lock()
_workers: dict[int, _Registered] = {}


def acquire_worker(collectives: object) -> CommWorker:
    """The worker of `collectives` (created on first use); pair with `release_worker`."""
    with _lock:
        entry = _workers.get(id(collectives))
        if entry is None or entry.collectives is not collectives:
            name = f"bagpipe-comm-r{getattr(collectives, 'rank', 0)}"
            entry = _Registered(collectives, CommWorker(name))
            _workers[id(collectives)] = entry
        entry.worker.users += 1
        return entry.worker


def release_worker(collectives: object) -> None:
    with _lock:
        entry = _workers.get(id(collectives))
        if entry is None or entry.collectives is not collectives:
            return
        entry.worker.users -= 1
        if entry.worker.users > 0:
            return
        del _workers[id(collectives)]
    entry.worker.shutdown()
