"""Runs W simulated ranks (threads) of BagPipe controllers over an ID trace in one process.

Used by the property tests and the cache benchmarks. Each rank thread drives its controller
the way the TorchRec layer does: it keeps `lookahead` batches submitted ahead of the step it
runs, reads `step.rows`, computes a row gradient and finishes the step.

A run's settings are one `SimulationSpec` (`simulate(config, trace, spec)`, or its fields as
keywords). The parameter server is pluggable (`PSBackend`): the exact numpy `ReferencePS` by
default, or any object with ``client(rank)``, ``committed_step()`` (the truth, min over
shards), ``snapshot()`` / ``snapshot_state()`` (every row and its optimizer state, after the
run) and ``close()`` — the tests plug the real in-process PS (PSShard + PSClient over the
local transport) in this way.

The table's optimizer (`optimizer`) and the learning rate of each step (`lr`: a constant, or a
function of the step: an LR schedule; for Adam the bias-corrected step size) are the run's;
`reference_run_with_state` replays them without cache, PS or threads.

The default gradient is ``noise(t, r) + 0.5 * rows``: it depends on the values read, so a stale
read changes the final weights, and it is a pure function of (step, rank, keys, rows), so the
reference run (`reference_run`) reproduces it exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.runtime.collectives import CollectiveAborted, ThreadGroup
from torchrec_bagpipe.runtime.controller import BagPipeController
from torchrec_bagpipe.runtime.eviction import EvictionSpec
from torchrec_bagpipe.testing.reference_eviction import ReferenceEvictionRule
from torchrec_bagpipe.testing.reference_ps import ReferencePS, reference_optimizer_step

__all__ = [
    "SimResult",
    "SimulationSpec",
    "default_grad",
    "reference_run",
    "reference_run_with_state",
    "simulate",
]

GradFn = Callable[[int, int, np.ndarray, np.ndarray], np.ndarray]
# The learning rate of each step: a constant or a function of the global step.
LR = float | Callable[[int], float]
Trace = Sequence[Sequence[np.ndarray]]  # trace[t][r]: rank r's fused keys at step t
# Called as (rank, kind, keys, deps, uses, at_step) before each get.
Observer = Callable[[int, str, np.ndarray, np.ndarray, np.ndarray, int], None]


class PSBackend(Protocol):
    def client(self, rank: int) -> Any: ...

    def committed_step(self) -> int: ...

    def snapshot(self) -> np.ndarray: ...

    def snapshot_state(self) -> np.ndarray: ...

    def close(self) -> None: ...


# (num_keys, dim, world_size, lr, divide, init, timeout, *, optimizer) -> a backend holding
# `init` (every row at its initial optimizer state).
BackendFactory = Callable[..., PSBackend]


def _lr_of(lr: LR) -> Callable[[int], float]:
    return lr if callable(lr) else (lambda t: float(lr))


def default_grad(t: int, r: int, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """noise(t, r, position) + 0.5 * rows, fp32 (a pure function of its arguments)."""
    rng = np.random.default_rng((t * 7919 + r * 104729 + 17) & 0xFFFFFFFF)
    noise = rng.standard_normal(rows.shape).astype(np.float32)
    return noise + np.float32(0.5) * rows.astype(np.float32)


@dataclass(frozen=True, kw_only=True)
class SimulationSpec:
    """One simulated run's settings (the BagPipe settings are the `BagPipeConfig`'s).

    The table: `num_keys` rows of `dim`, trained with `optimizer` at `lr` (a constant, or a
    function of the step), `world_size` ranks (None: the trace's). Its initial rows: `init`
    ([num_keys, dim]; None: uniform in ±0.5 drawn from `seed`). Each rank's gradient is
    `grad_fn(t, r, unique_keys, rows)`; the caches live on `device`. `record_reads` keeps
    every step's rows (`SimResult.reads`); every wait is bounded by `timeout`; the default PS
    applies each step `ps_apply_delay` seconds late. Hooks: `observer` before each get,
    `step_hook(rank, controller)` after each step, `backend` builds another PS (module
    docstring). Before step t each rank has submitted the batches up to t + window
    (`BagPipeConfig.window_batches`) + `submit_ahead` (TorchRec's pipeline runs the next
    batch's input_dist before the forward: `submit_ahead=1`). `progress`: rank 0 shows the
    prescan planner's bar.
    """

    num_keys: int
    dim: int
    lr: LR = 0.1
    optimizer: OptimizerSpec | str | dict[str, Any] = "sgd"
    world_size: int | None = None
    init: np.ndarray | None = None
    seed: int = 0
    grad_fn: GradFn = default_grad
    device: torch.device | str | None = None
    record_reads: bool = False
    timeout: float = 60.0
    ps_apply_delay: float = 0.0
    observer: Observer | None = None
    step_hook: Callable[[int, BagPipeController], None] | None = None
    progress: bool = False
    backend: BackendFactory | None = None
    submit_ahead: int = 0
    eviction: EvictionSpec | None = None  # a virtual table's rule (None: an ordinary table)

    def __post_init__(self) -> None:
        for name in ("num_keys", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.submit_ahead < 0:
            raise ValueError(f"submit_ahead must be >= 0, got {self.submit_ahead}")
        object.__setattr__(self, "optimizer", OptimizerSpec.of(self.optimizer))


@dataclass
class SimResult:
    metrics: list[dict[str, Any]]
    final: np.ndarray
    reads: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    ps: Any = None
    final_state: np.ndarray | None = None  # every row's optimizer state on the PS
    # Per rank, after the last step: the resident rows' keys and cached [weights | state].
    cached: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


def _open_ps(spec: SimulationSpec, world_size: int, divide: bool, steps: int) -> Any:
    """The run's PS: the exact `ReferencePS`, or the spec's backend holding the same rows."""
    lr_of = _lr_of(spec.lr)
    if spec.backend is None:
        return ReferencePS(spec.num_keys, spec.dim, world_size, lr_of(0), divide=divide,
                           seed=spec.seed, init=spec.init, timeout=spec.timeout,
                           apply_delay=spec.ps_apply_delay, optimizer=spec.optimizer)
    init = spec.init
    if init is None:
        init = np.random.default_rng(spec.seed).uniform(-0.5, 0.5, (spec.num_keys, spec.dim))
    # A PS table is opened with a configured lr > 0; a schedule may be 0 for a while
    # (warm-up). Every commit carries its step's lr, so the configured one is only a default.
    open_lr = max([lr_of(t) for t in range(steps)] + [lr_of(0)])
    open_lr = open_lr if open_lr > 0 else 1.0
    return spec.backend(spec.num_keys, spec.dim, world_size, open_lr, divide,
                        np.asarray(init, dtype=np.float32), spec.timeout,
                        optimizer=spec.optimizer)


def simulate(config: BagPipeConfig, trace: Trace, spec: SimulationSpec | None = None, /,
             **fields: Any) -> SimResult:
    """Trains `len(trace)` steps with W rank threads against an in-process PS, as `spec`
    says (a `SimulationSpec`, or its fields as keywords), step t at learning rate `lr(t)`."""
    if spec is None:
        spec = SimulationSpec(**fields)
    elif fields:
        spec = dataclasses.replace(spec, **fields)
    W = spec.world_size if spec.world_size is not None else len(trace[0]) if trace else 1
    for t, per_rank in enumerate(trace):
        if len(per_rank) != W:
            raise ValueError(f"trace step {t} has {len(per_rank)} ranks, expected {W}")
    steps = len(trace)
    ps = _open_ps(spec, W, config.resolved_gradient_division(), steps)
    lr_of = _lr_of(spec.lr)
    clients = [ps.client(r) for r in range(W)]
    group = ThreadGroup(W, timeout=spec.timeout)
    timeout = spec.timeout
    metrics: list[dict[str, Any]] = [{} for _ in range(W)]
    cached: list[tuple[np.ndarray, np.ndarray]] = [
        (np.zeros(0, np.int64), np.zeros((0, spec.dim), np.float32)) for _ in range(W)]
    reads: dict[tuple[int, int], np.ndarray] = {}
    errors: list[BaseException] = []
    final: list[np.ndarray] = []
    final_state: list[np.ndarray] = []
    done = threading.Barrier(W)
    done2 = threading.Barrier(W)
    look = config.window_batches + spec.submit_ahead

    def rank_main(r: int) -> None:
        ctl = None
        try:
            ctl = BagPipeController(
                config, rank=r, world_size=W, dim=spec.dim, num_keys=spec.num_keys,
                lr=lr_of(0), ps=clients[r], collectives=group.collectives(r),
                device=spec.device, optimizer=spec.optimizer, eviction=spec.eviction,
            )
            if spec.observer is not None:
                observer = spec.observer
                ctl.fetch_observer = lambda *a: observer(r, *a)
            if config.optimization_prescan:
                ctl.prescan([np.asarray(trace[t][r], dtype=np.int64) for t in range(steps)],
                            progress=spec.progress and r == 0)
            submitted = 0
            for t in range(steps):
                while submitted < min(steps, t + look + 1):
                    ctl.submit(torch.from_numpy(np.asarray(trace[submitted][r], dtype=np.int64)))
                    submitted += 1
                step = ctl.next_step()
                rows = step.rows.detach().cpu().numpy()
                if spec.record_reads:
                    reads[(t, r)] = rows.copy()
                g = spec.grad_fn(t, r, step.unique_keys.numpy(), rows)
                grad = torch.from_numpy(np.ascontiguousarray(g)).to(step.rows.device)
                ctl.finish_step(step, grad, lr=lr_of(t))
                if spec.step_hook is not None:
                    spec.step_hook(r, ctl)
            ctl.flush()
            metrics[r] = ctl.metrics()
            keys, rows = ctl.cached_rows()
            cached[r] = (keys, rows.cpu().numpy())
            done.wait(timeout)  # every rank drained: the PS holds the final values
            if r == 0:
                final.append(ps.snapshot())
                final_state.append(ps.snapshot_state())
            done2.wait(timeout)
            ctl.close()
            ctl = None
        except BaseException as e:
            errors.append(e)
            group.abort(e)
            done.abort()
            done2.abort()
        finally:
            if ctl is not None:
                with contextlib.suppress(BaseException):
                    ctl.close()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(W)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout * 4)
        if any(th.is_alive() for th in threads):
            raise TimeoutError("simulate: a rank thread did not finish")
    finally:
        if spec.backend is not None:
            ps.close()
    if errors:
        # Prefer the root cause over the aborts it triggered on other ranks.
        root = [e for e in errors
                if not isinstance(e, (CollectiveAborted, threading.BrokenBarrierError))]
        raise (root or errors)[0]
    return SimResult(metrics=metrics, final=final[0], reads=reads, ps=ps,
                     final_state=final_state[0], cached=cached)


def reference_run(
    trace: Trace,
    *,
    init: np.ndarray,
    lr: LR,
    divide: bool = True,
    grad_fn: GradFn = default_grad,
    reads: dict[tuple[int, int], np.ndarray] | None = None,
) -> np.ndarray:
    """Plain synchronous SGD over the trace (no cache, no PS, no threads): the final rows.
    See `reference_run_with_state`."""
    return reference_run_with_state(trace, init=init, lr=lr, divide=divide, grad_fn=grad_fn,
                                    reads=reads)[0]


def reference_run_with_state(
    trace: Trace,
    *,
    init: np.ndarray,
    lr: LR,
    divide: bool = True,
    grad_fn: GradFn = default_grad,
    reads: dict[tuple[int, int], np.ndarray] | None = None,
    optimizer: OptimizerSpec | str | dict[str, Any] = "sgd",
    eviction: EvictionSpec | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Synchronous training of the table with `optimizer` over the trace, step t at `lr(t)`
    (no cache, no PS, no threads): the final rows and their optimizer state.

    When `reads` is given, checks that every recorded read equals the reference values
    before that step bitwise (invariant 1), raising AssertionError naming step and rank.
    With `eviction` (a virtual table), the keys the rule (`ReferenceEvictionRule`, fed every
    rank's keys of each step) evicts at a step's boundary go back to their `init` rows and
    initial state after that step's update: a read of an evicted row that is not its initial
    value fails the freshness check.
    """
    spec = OptimizerSpec.of(optimizer)
    lr_of = _lr_of(lr)
    values = np.array(init, dtype=np.float32, copy=True)
    initial = values.copy()
    state = spec.initial_state(values.shape[0], values.shape[1]).numpy()
    rule = ReferenceEvictionRule(eviction) if eviction is not None else None
    for t, per_rank in enumerate(trace):
        W = len(per_rank)
        keys_by_rank, grads_by_rank = [], []
        # Admission: the ids the rule trains at this step (each decided once per step, in
        # rank order of first occurrence, as the planner); the others read a zero row.
        admitted: dict[int, bool] = {}
        for r in range(W):
            for k in np.asarray(per_rank[r], dtype=np.int64).tolist():
                if k not in admitted:
                    admitted[k] = rule.admit(k) if rule is not None else True
        for r in range(W):
            keys = np.asarray(per_rank[r], dtype=np.int64)
            _, first = np.unique(keys, return_index=True)
            uniq = keys[np.sort(first)]  # first-occurrence order, as the planner
            refused = np.array([not admitted[int(k)] for k in uniq], dtype=bool)
            uniq = uniq[~refused]
            rows = values[uniq]
            if refused.any():
                rows = np.concatenate([rows, np.zeros((1, rows.shape[1]), np.float32)])
            if reads is not None:
                got = reads[(t, r)]
                if got.shape != rows.shape or not np.array_equal(
                    got.view(np.uint32), rows.view(np.uint32)
                ):
                    same_shape = got.shape == rows.shape
                    bad = np.nonzero((got != rows).any(axis=1))[0] if same_shape else []
                    raise AssertionError(
                        f"freshness violated at step {t}, rank {r}: rows "
                        f"{[int(uniq[i]) for i in bad[:5]]} differ from the PS after step {t - 1}"
                    )
            keys_by_rank.append(uniq)
            grads_by_rank.append(grad_fn(t, r, uniq, rows)[:uniq.size])
        reference_optimizer_step(values, state, keys_by_rank, grads_by_rank, lr_of(t), W, divide,
                                 spec)
        if rule is not None:
            gone = rule.on_step(t, (int(k) for ks in keys_by_rank for k in ks))
            if gone:
                idx = np.asarray(gone, dtype=np.int64)
                values[idx] = initial[idx]
                state[idx] = spec.initial_state(idx.size, values.shape[1]).numpy()
    return values, state
