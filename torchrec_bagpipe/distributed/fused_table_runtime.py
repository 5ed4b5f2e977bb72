"""`FusedTableRuntime`: the one path from a sharded BagPipe module to the PS, per fused table.

A fused table (types.py) trains through a `BagPipeController` (runtime/): submitted batches
become steps whose rows come from this rank's cache or the PS, and whose gradients the
controller commits. Reads and writes outside the step sequence (eval lookups, state-dict
reads and writes, initial weights) go to the fused table's PS session directly. This class
puts both behind one typed API: the TorchRec layer never holds a PS client or reaches into
the controller. `build_fused_table` opens the PS session and the controller of one fused
table on this rank.

Thread-safety: one caller at a time (the rank's training thread, or its autograd thread
calling `finish_step` while the training thread waits in backward).

Invariants:
1. Every read outside the step sequence (`eval_rows`, `read_rows`) and every `write_rows`
   first waits until each commit submitted so far is applied: reads see the PS after the
   last finished step (a running step stays running: reads never finish it), and no
   pending commit lands after a write (which requires no running step).
2. `write_rows` changes rows behind every rank's cache; `invalidate` (on every rank, after
   the writes) must run before the next step reads rows.
3. Direct reads and writes name fused keys in `[0, spec.num_keys)` and at most a bounded
   range per call (table_io.py chunks whole tables).
4. Every failed periodic PS checkpoint the shards report reaches the rank: one warning on
   its log per failure, the counters in `metrics()`, and `PSCheckpointError` from
   `check_checkpoints` (after each finished step) once a shard has failed
   `ps_checkpoint_max_failures` in a row.
5. The controller numbers its steps from 0; PS step = controller step + `start_step` + 1,
   where `start_step` is the job's expectation (-1 for a fresh job, the checkpoint's step
   for a resumed one), declared to the shards when the session opens
   (`ClientSpec.expected_step`: each shard refuses it unless the table is at that committed
   step) and given to the controller, which numbers the PS steps itself: a fresh job never
   meets a table the PS already advanced.
6. Every finished step commits at the learning rate its `StepLearningRate` gives when it
   finishes (the fused optimizer's param group: an LR schedule's value, Adam's
   bias-corrected step size), and the source hears of every step whose commit was
   submitted, once, in step order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.job import BagPipeJob
from torchrec_bagpipe.distributed.types import FusedTableSpec

if TYPE_CHECKING:
    from torchrec_bagpipe.ps.client import PSClient
    from torchrec_bagpipe.runtime.controller import BagPipeController, Step

__all__ = ["FusedTableRuntime", "PSCheckpointError", "StepLearningRate", "build_fused_table"]

_log = logging.getLogger("torchrec_bagpipe")


class PSCheckpointError(RuntimeError):
    """A PS shard failed too many periodic checkpoints in a row: the recovery point lags."""


class StepLearningRate(Protocol):
    """Where a fused table's learning rate of each step comes from (the fused optimizer's
    param group implements it; fused_optimizer.py)."""

    def next_lr(self) -> float:
        """The learning rate of the next step to finish (finite, >= 0; Adam: the
        bias-corrected step size). Raises ValueError for an unusable one."""
        ...

    def step_finished(self) -> None:
        """The step `next_lr` was asked for committed its gradient: the next is the step
        after."""
        ...


class _ConstantLR:
    """A fused table's configured learning rate, every step (no fused optimizer)."""

    def __init__(self, lr: float) -> None:
        self._lr = lr

    def next_lr(self) -> float:
        return self._lr

    def step_finished(self) -> None:
        return None


class FusedTableRuntime:
    """One fused table's runtime on this rank: training steps and direct PS access."""

    def __init__(self, spec: FusedTableSpec, client: PSClient,
                 controller: BagPipeController, *, lr: StepLearningRate | None = None,
                 max_checkpoint_failures: int = 3, start_step: int = -1) -> None:
        self._spec = spec
        self._client = client
        self._controller = controller
        self._lr = lr if lr is not None else _ConstantLR(spec.lr)  # invariant 6
        self._max_checkpoint_failures = max_checkpoint_failures
        self._checkpoints_seen = 0  # failed periodic checkpoints already reported
        self.start_step = start_step  # the PS step this session started after (invariant 5)

    @property
    def spec(self) -> FusedTableSpec:
        return self._spec

    @property
    def name(self) -> str:
        """The fused table's PS table name (unique per job)."""
        return self._spec.name

    # ---- the step sequence (the controller) ---------------------------------------------------
    def submit(self, keys: torch.Tensor) -> None:
        """The next training batch's fused keys (1-D int64, CPU) enter the lookahead window."""
        self._controller.submit(keys)

    def check_submit(self, keys: torch.Tensor) -> None:
        """Raises what `submit(keys)` would raise (a closed or failed runtime, keys out of
        range, a prescan mismatch), without submitting anything."""
        self._controller.check_submit(keys)

    def prescan(self, trace: Sequence[torch.Tensor], *, progress: bool) -> None:
        """Hands the whole training trace (this rank's fused keys per step) to the planner
        (a collective). REQUIRES: nothing submitted yet; prescan mode in the config."""
        self._controller.prescan(trace, progress=progress)

    def next_step(self) -> Step:
        """The oldest submitted batch's step: its unique rows (a leaf on the device) and the
        inverse map. REQUIRES: the previous step finished."""
        return self._controller.next_step()

    def finish_step(self, step: Step, grad: torch.Tensor) -> None:
        """Commits `step`'s row gradient (|U| x dim fp32) at the step's learning rate
        (invariant 6). An unusable learning rate or gradient raises before anything changed
        (the step keeps running); any other error fails the runtime. The caller then runs
        `check_checkpoints` (invariant 4). REQUIRES: `step` is the running step."""
        self._controller.finish_step(step, grad, lr=self._lr.next_lr())
        self._lr.step_finished()

    def committed_step(self) -> int:
        """The table's committed PS step (the minimum over its shards, as this rank saw it)."""
        return self._client.committed_step()

    def checkpoint(self, label: str) -> int:
        """Checkpoints the table on every shard into the shard's checkpoint directory's
        subdirectory `label`, at its committed step (after every pending commit); returns
        that step. Raises RuntimeError if the shards saved different steps (a rank still
        committing). REQUIRES: no step running, every rank's commits drained."""
        self._controller.flush()
        steps = self._client.checkpoint(label=label)
        if len(set(steps)) != 1:
            raise RuntimeError(
                f"BagPipe fused table {self.name!r}: its shards checkpointed different steps "
                f"{steps} (a rank was still committing)"
            )
        return int(steps[0])

    def checkpoint_report(self) -> dict[str, object]:
        """The shards' periodic checkpoints of this table (`PSClient.checkpoint_report`)."""
        return self._client.checkpoint_report()

    def check_checkpoints(self) -> None:
        """Warns once per new failed periodic checkpoint; raises PSCheckpointError once a
        shard failed `ps_checkpoint_max_failures` in a row (invariant 4)."""
        report = self._client.checkpoint_report()
        failed = int(report["failed"])  # type: ignore[arg-type]
        if failed <= self._checkpoints_seen:
            return
        self._checkpoints_seen = failed
        run = int(report["consecutive_failures"])  # type: ignore[arg-type]
        _log.warning("BagPipe fused table %r: %s (%d failed in a row; the PS recovery point "
                     "lags the committed step)", self.name, report["last_error"], run)
        limit = self._max_checkpoint_failures
        if limit and run >= limit:
            raise PSCheckpointError(
                f"BagPipe fused table {self.name!r}: {run} periodic PS checkpoints failed in a "
                f"row (BagPipeConfig.ps_checkpoint_max_failures={limit}); the last: "
                f"{report['last_error']}"
            )

    def flush(self) -> None:
        """Waits until every commit submitted so far is applied (bounded by ps_timeout).
        REQUIRES: no step running."""
        self._controller.flush()

    def invalidate(self) -> None:
        """Forgets every cached and prefetched row (after writes to the PS). REQUIRES: no step
        running."""
        self._controller.invalidate_all()

    def metrics(self) -> dict[str, float]:
        """The controller's counters and timings, plus the shards' periodic checkpoints
        (ps_checkpoints, ps_checkpoint_failures, ps_checkpoint_failures_in_a_row)."""
        m = self._controller.metrics()
        try:
            report = self._client.checkpoint_report()
        except RuntimeError:  # the client is closed: its counters are gone
            return m
        m["ps_checkpoints"] = float(report["succeeded"])  # type: ignore[arg-type]
        m["ps_checkpoint_failures"] = float(report["failed"])  # type: ignore[arg-type]
        m["ps_checkpoint_failures_in_a_row"] = float(
            report["consecutive_failures"])  # type: ignore[arg-type]
        return m

    # ---- direct PS access, outside the step sequence ---------------------------------------
    def eval_rows(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique rows [U, dim] fp32 CPU, inverse [n] int64 CPU) for fused `keys` (CPU
        int64), read from the PS after the commits of every finished step (a running step
        stays running)."""
        self._controller.drain()
        unique, inverse = torch.unique(keys, return_inverse=True)
        return self._client.lookup(unique), inverse

    @property
    def state_dim(self) -> int:
        """Optimizer state floats per row (0 for SGD)."""
        return self._spec.optimizer.state_dim(self._spec.dim)

    def read_rows(self, start: int, stop: int, *, with_state: bool = False) -> torch.Tensor:
        """Fused rows [start, stop) as [stop - start, dim] fp32 CPU (with their optimizer
        state after the weights: [.., dim + state_dim], when `with_state`), read from the PS
        after the commits of every finished step (one request: keep the range bounded; a
        running step stays running)."""
        self._check_range(start, stop)
        self._controller.drain()
        return self._client.lookup(torch.arange(start, stop, dtype=torch.int64),
                                   with_state=with_state)

    def write_rows(self, start: int, rows: torch.Tensor, *, with_state: bool = False) -> None:
        """Writes `rows` ([n, dim]: stored rows keep their optimizer state; with `with_state`
        [n, dim + state_dim]: weights and state) as fused rows [start, start + n), after
        every pending commit (one request: keep n bounded). Caches stay stale until
        `invalidate`. REQUIRES: no step running."""
        width = self._spec.dim + (self.state_dim if with_state else 0)
        if rows.dim() != 2 or rows.shape[1] != width:
            raise ValueError(
                f"BagPipe fused table {self.name!r}: rows of shape {tuple(rows.shape)} do not "
                f"fit its width {width}"
            )
        stop = start + int(rows.shape[0])
        self._check_range(start, stop)
        self._controller.flush()
        keys = torch.arange(start, stop, dtype=torch.int64)
        self._client.assign(keys, rows.detach().to("cpu", torch.float32).contiguous(),
                            with_state=with_state)

    def close(self) -> None:
        """Drains pending commits and closes the controller and the PS session (idempotent)."""
        try:
            self._controller.close()
        finally:
            self._client.close()  # idempotent; the controller closed it unless it failed

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self._spec.num_keys:
            raise ValueError(
                f"BagPipe fused table {self.name!r}: rows [{start}, {stop}) lie outside "
                f"[0, {self._spec.num_keys})"
            )


def build_fused_table(
    spec: FusedTableSpec, *, job: BagPipeJob, config: BagPipeConfig,
    lr: StepLearningRate | None = None,
) -> FusedTableRuntime:
    """Opens the PS session of one fused table and its controller on this rank; `lr`: where
    each step's learning rate comes from (None: the fused table's configured lr).

    Rows never written read as TorchRec's default init, uniform in ±bound of their own
    table (deterministic, computed on the PS); tables with other initial weights are
    written by the caller right after (table_io.py). The table must be at the committed
    step the job expects (`BagPipeJob.expected_step`: -1, or the step of the checkpoint it
    resumes from): the session declares it and every shard refuses it otherwise
    (`ps.client.StartStepError` naming the table and the steps); the
    controller's steps follow it (invariant 5).
    """
    from torchrec_bagpipe.ps.client import PSClient
    from torchrec_bagpipe.ps.config_specs import client_spec
    from torchrec_bagpipe.runtime.controller import BagPipeController

    if spec.eviction is not None and spec.eviction.enabled and job.resumed is not None:
        # The eviction rule's counts are not in whole-job checkpoints yet: a resumed run
        # would evict other rows than the uninterrupted one (docs/virtual_tables.md).
        raise ValueError(
            f"fused table {spec.name!r} (virtual tables {[t.name for t in spec.tables]}) "
            "evicts rows; resuming such a table from a whole-job checkpoint is not supported "
            "yet (the eviction rule's state is not checkpointed)"
        )
    start = job.expected_step(spec.name)
    client = PSClient(job.endpoints, client_spec(
        config,
        table=spec.name,
        dim=spec.dim,
        lr=spec.lr,
        rank=job.rank,
        world_size=job.world_size,
        job_token=job.job_token,
        init="uniform",
        init_bound=[(spec.offsets[t.name], t.init_max) for t in spec.tables],
        key_bound=spec.num_keys,
        optimizer=spec.optimizer,
        expected_step=start,  # every shard refuses the session unless it is at this step
    ))
    try:
        controller = BagPipeController(
            config,
            rank=job.rank,
            world_size=job.world_size,
            dim=spec.dim,
            num_keys=spec.num_keys,
            lr=spec.lr,
            ps=client,
            collectives=job.collectives,
            device=job.device,
            optimizer=spec.optimizer,
            # A virtual table's rule; TorchRec's trigger counts ids per trainer rank.
            eviction=None if spec.eviction is None else dataclasses.replace(
                spec.eviction, trigger_rows=spec.eviction.trigger_rows * job.world_size),
            start_step=start,
        )
    except BaseException:
        client.close()
        raise
    return FusedTableRuntime(spec, client, controller, lr=lr,
                             max_checkpoint_failures=config.ps_checkpoint_max_failures,
                             start_step=start)
