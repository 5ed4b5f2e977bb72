"""`BagPipeTables`: the tables of one sharded module that the plan places on BagPipe.

Shared by the sharded EmbeddingBagCollection (embeddingbag.py) and EmbeddingCollection
(embedding.py): both hand this class their BagPipe tables and differ only in what they make
of the rows a batch reads (pooled bags or one embedding per id). It owns

* the layout (layout.py): tables, slots, fused tables, KJT -> fused keys;
* one `FusedTableRuntime` per fused table (the one path to the PS), the `TableIO` over
  them and the `TableState` (table_state.py) through which every state-dict read and write
  of these tables goes: live row-wise sharded tensors of PS views;
* the fused optimizer (fused_optimizer.py), one param group per fused table, and its
  optimizer state in TorchRec's layout (`read_optimizer_state` / `load_optimizer_state`,
  the same live tensors);
* the step lifecycle: lookahead submissions (`presubmit`, `hold_submissions`), the batch
  entering `input_dist` (`enter`), the rows a batch reads (`batch_rows`: the runtime's next
  step of every fused table in training, the PS in eval), pending steps and their
  zero-gradient finishes (below);
* `PSTableView`, the `<table>` submodules that carry the placeholder parameters and the
  state-dict access of each table;
* the end of a state-dict write phase (`TableState.settle`) before the next batch enters.

Thread-safety: one training thread per rank (the autograd thread runs the backward hook
while that thread waits in backward).

The step lifecycle. A training forward (module training, autograd enabled) takes one step
of every fused table; the step is *pending* until its rows' gradient arrives in backward
(the step commits it) or until an explicit end of step finishes it with a zero gradient:
the fused optimizer's `step()` (a step whose loss did not depend on its rows), `flush()`,
`close()`. Between a training forward and its backward:

* reads of the live state-dict tensors (`table_weight`, `read_optimizer_state`) and eval
  forwards see the weights as of the last finished step (the commits of finished steps
  drained; the pending step stays pending, as stock TorchRec's fused update has not run
  either);
* a write (`copy_` into those tensors, `write_table`, `load_optimizer_state`) raises
  RuntimeError before writing anything (its rows would be overwritten under the pending
  step's gradient);
* another training forward raises RuntimeError before taking a step; its batch stays
  submitted, so the same batch may enter again once the backward ran.

A training-mode forward under `torch.no_grad()` is an eval read: it submits nothing and
takes no step (so one rank may run it alone). A batch whose `input_dist` ran with autograd
enabled is submitted; if its compute then runs without autograd, its steps are finished at
once with a zero gradient. Once the backward of a forward ran, the steps of that forward
that got no gradient (their fused table did not reach the loss; or a gradient the finite
check refused) are finished with a zero gradient by the next forward or load.

Invariants:
1. Each fused table's steps are consumed in submission order; `batch_rows` checks the step
   it gets belongs to its batch (same fused keys) and refuses anything else.
2. At most one training forward is outstanding (`_forward`): its steps, one per fused
   table, are the only pending ones; a zero-gradient finish happens only at an explicit end
   of step or after that forward's backward ran (above); every finish goes through the
   fused optimizer, which gives it the step's learning rate.
3. A batch is submitted to every fused table or to none: all are checked (`check_submit`)
   before the first submission; a submission failing after that leaves the module broken
   (every later call raises).
4. The PS is the only owner of row values and their optimizer state; the state-dict
   tensors (and the fused optimizer's state) are live views that read them through
   `TableIO` after the commits of finished steps (a pending step stays pending) and write
   them only when no forward waits for its backward; the next batch (or the end of a load)
   settles the ranks, dropping every cache when any rank wrote.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.agreement import agree_before_open, describe
from torchrec_bagpipe.distributed.fused_optimizer import BagPipeFusedOptimizer, FusedGroup
from torchrec_bagpipe.distributed.fused_table_runtime import FusedTableRuntime, build_fused_table
from torchrec_bagpipe.distributed.grad_check import check_finite_grad
from torchrec_bagpipe.distributed.job import BagPipeJob, job_for
from torchrec_bagpipe.distributed.layout import FusedLayout, table_specs
from torchrec_bagpipe.distributed.lookup import BatchRows, eval_rows, train_step
from torchrec_bagpipe.distributed.table_io import TableIO
from torchrec_bagpipe.distributed.table_optimizer import TableOptimizer
from torchrec_bagpipe.distributed.table_state import TableState

if TYPE_CHECKING:
    from torchrec_bagpipe.runtime.controller import Step

__all__ = ["BagPipeTables", "PSTableView", "agreed_layout"]


class PSTableView(nn.Module):
    """`<collection>.<table>` of a BagPipe table: a placeholder `weight` plus state-dict
    access to the PS.

    The placeholder is an empty (0, dim) parameter that carries `_in_backward_optimizers`
    (so TorchRec's `in_backward_optimizer_filter` keeps it out of the dense optimizer) and
    never receives a gradient; the table's values are read from / written to the PS through
    the owner's `TableIO`.
    """

    def __init__(self, owner: BagPipeTables, table: str, dim: int,
                 device: torch.device) -> None:
        super().__init__()
        # A plain attribute, not a submodule: the owner is no module, and the sharded module
        # that holds both must not become a cycle in the module tree.
        object.__setattr__(self, "_owner", owner)
        self._table = table
        weight = nn.Parameter(torch.empty(0, dim, device=device), requires_grad=False)
        weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        self.weight = weight

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        # A row-wise ShardedTensor of live PS views (table_state.py): nothing is read here.
        destination[prefix + "weight"] = self._owner.table_weight(self._table)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        shape = self._owner.table_shape(self._table)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {got}, the BagPipe "
                f"table {self._table!r} has shape {shape}"
            )
            return
        self._owner.write_table(self._table, value)


class BagPipeTables:
    """The BagPipe tables of one sharded module (see module docstring).

    Args:
        job, layout: the process's job and these tables' layout, as `agreed_layout` returns
            them (every rank agreed on them; nothing is open on the PS yet).
        configs: the BagPipe tables' configs, in module order.
        weights: the unsharded module's weight of each table (`meta` when not materialised).
        param_prefix: the collection attribute the tables' parameters live under
            (`embedding_bags` for an EBC, `embeddings` for an EC).
    """

    def __init__(
        self,
        job: BagPipeJob,
        layout: FusedLayout,
        configs: Sequence[BaseEmbeddingConfig],
        weights: Mapping[str, torch.Tensor],
        *,
        device: torch.device,
        config: BagPipeConfig,
        param_prefix: str,
    ) -> None:
        self.config = config
        self._device = device
        self._job = job
        self.layout = layout
        fused = self.layout.fused
        self.runtimes: list[FusedTableRuntime] = []
        try:
            for spec in fused:
                self.runtimes.append(build_fused_table(spec, job=self._job, config=config))
            self._io = TableIO(self.layout, self.runtimes, self._job)
            self._io.write_initial_weights(
                {t.name: weights[t.name] for t in self.layout.tables},
                {cfg.name: cfg.init_fn for cfg in configs},
            )
        except BaseException:
            for rt in self.runtimes:
                with contextlib.suppress(Exception):
                    rt.close()
            raise

        self.views: dict[str, PSTableView] = {
            t.name: PSTableView(self, t.name, t.dim, device) for t in self.layout.tables
        }
        self.optimizer = BagPipeFusedOptimizer(
            {f"{param_prefix}.{name}.weight": view.weight for name, view in self.views.items()},
            [
                FusedGroup(spec.name, spec.lr, spec.optimizer, [t.name for t in spec.tables],
                           [self.views[t.name].weight for t in spec.tables])
                for spec in fused
            ],
            finish_fn=self._finish,
            pending_fn=self.finish_pending,
            state_io=self,
        )
        self.state = TableState(self.layout, self._io, self.runtimes, self._job,
                                drain=self._drain_for_state,
                                on_settle=self.optimizer.settle_steps)

        self._presubmitted: deque[_Ahead] = deque()
        self._held: list[list[torch.Tensor]] | None = None
        self._pending: list[deque[Step]] = [deque() for _ in fused]
        self._forward: _Forward | None = None  # the outstanding training forward
        self._broken: BaseException | None = None  # invariant 3
        self._closed = False
        self._job.register(self)

    # ---- a batch entering the module -------------------------------------------------------
    def enter(self, features: KeyedJaggedTensor, training: bool
              ) -> tuple[list[KeyedJaggedTensor], list[torch.Tensor]]:
        """`input_dist` of one batch: per fused table, the KJT in slot order and its fused
        keys. A training batch enters the runtime's window: it is submitted, or checked to
        be the batch `presubmit` submitted ahead, or held (`hold_submissions`)."""
        self.check_open()
        self.state.settle()
        ahead = self._presubmitted[0] if training and self._presubmitted else None
        if ahead is not None and _same_data(ahead.signature, _signature(features)):
            # The very tensors submitted ahead (not modified since): reuse their split.
            per_group, keys = ahead.per_group, ahead.keys
        else:
            per_group, keys = self.layout.split(features)
        if training:
            self._enter_window(keys)
        return per_group, keys

    def batch_rows(self, keys: Sequence[torch.Tensor], training: bool) -> list[BatchRows]:
        """The rows a batch of fused `keys` (one tensor per fused table) reads from each
        fused table: in training (the batch was submitted) the runtime's next step of every
        fused table (leaves whose gradients commit the steps), otherwise the PS after the
        commits of every finished step (module docstring)."""
        self.check_open()
        if training:
            return self._train_rows(keys)
        return [eval_rows(rt, k, self._device) for rt, k in zip(self.runtimes, keys)]

    # ---- lookahead (BagPipeTrainPipeline) ------------------------------------------------------
    def presubmit(self, features: KeyedJaggedTensor) -> None:
        """Submits a future training batch to the runtime's lookahead window; `enter` of the
        same batch, later, then only checks it matches."""
        self.check_open()
        self.state.settle()
        per_group, keys = self.layout.split(features)
        self._submit(keys)
        self._presubmitted.append(_Ahead(_signature(features), per_group, keys))

    def hold_submissions(self) -> None:
        """Queues the batches `enter` would submit until `release_submissions`."""
        if self._held is None:
            self._held = []

    def release_submissions(self) -> None:
        held, self._held = self._held, None
        for keys in held or []:
            self._submit(keys)

    def prescan(self, features: Iterable[KeyedJaggedTensor], progress: bool | None = None
                ) -> None:
        """Hands the whole trace (every step's local batch, in order) to each fused table's
        runtime (a collective: every rank calls it). `progress`: show the planner's bar
        (default: on rank 0).

        REQUIRES: no batch submitted yet; `optimization_prescan` set in the config.
        """
        self.check_open()
        if not self.config.optimization_prescan:
            raise ValueError(
                "prescan() needs BagPipeConfig(optimization_prescan=True) "
                "(--optimization-prescan)"
            )
        traces: list[list[torch.Tensor]] = [[] for _ in self.runtimes]
        for kjt in features:
            _, keys = self.layout.split(kjt)
            for g, k in enumerate(keys):
                traces[g].append(k)
        show = self._job.rank == 0 if progress is None else progress
        for g, rt in enumerate(self.runtimes):
            rt.prescan(traces[g], progress=show)

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Runtime metrics per fused table (plain dicts)."""
        return {rt.name: rt.metrics() for rt in self.runtimes}

    def flush(self) -> None:
        """Finishes gradient-less steps and waits until every pending commit is applied."""
        self.finish_pending()
        for rt in self.runtimes:
            rt.flush()

    def close(self) -> None:
        """Drains pending commits and closes the runtimes (idempotent)."""
        if self._closed:
            return
        try:
            self.finish_pending()
            for rt in self.runtimes:
                rt.flush()
        finally:
            self._closed = True
            for rt in self.runtimes:
                rt.close()
            self._job.unregister(self)

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this BagPipe module was closed; its PS sessions are gone")
        if self._broken is not None:
            raise RuntimeError(
                f"this BagPipe module cannot continue: a batch reached only some of its fused "
                f"tables ({self._broken!r})"
            )

    # ---- state dict access (every read and write goes through TableState) ---------------------
    def table_shape(self, table: str) -> tuple[int, int]:
        return self._io.shape(table)

    def table_weight(self, table: str) -> torch.Tensor:
        """The table's weights: a row-wise ShardedTensor of live PS views (table_state.py)."""
        self.check_open()
        return self.state.weight(table)

    def write_table(self, table: str, value: torch.Tensor) -> None:
        """A state-dict load of one table: this rank's rows of `value` (plain or sharded)
        into the PS; `finish_load` settles the ranks. Raises RuntimeError, writing nothing,
        between a training forward and its backward."""
        self._drain_for_state(write=True)
        self.state.load_weight(table, value)

    def finish_load(self) -> None:
        """After a state-dict load: every rank waits for the others' writes, then drops its
        cached rows (a collective)."""
        self.state.settle()

    def _drain_for_state(self, write: bool) -> None:
        """Before a state-dict read or write of the PS rows: the module is open; a write also
        needs no forward waiting for its backward (`close_forward`). A read leaves a pending
        step pending: the runtime reads after the commits of finished steps."""
        self.check_open()
        if write:
            self.close_forward("writing a BagPipe table's state (a load)")

    # ---- optimizer state (the fused optimizer's OptimizerStateIO) -------------------------------
    def read_optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """The table's optimizer state in TorchRec's layout: live row-wise ShardedTensors."""
        self.check_open()
        return dict(self.state.optimizer_state(table))

    def load_optimizer_state(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Writes this rank's rows of tables' optimizer states (plain or sharded values; every
        rank calls it), then settles the ranks. Raises RuntimeError, writing nothing, between
        a training forward and its backward."""
        self._drain_for_state(write=True)
        for table, tensors in states.items():
            self.state.load_optimizer_state(table, tensors)
        self.state.settle()

    # ---- step lifecycle -----------------------------------------------------------------------
    def _submit(self, keys: list[torch.Tensor]) -> None:
        """Submits one batch to every fused table, or to none (invariant 3)."""
        for rt, k in zip(self.runtimes, keys):
            rt.check_submit(k)
        done = 0
        try:
            for rt, k in zip(self.runtimes, keys):
                rt.submit(k)
                done += 1
        except BaseException as e:
            if done:
                self._broken = e
            raise

    def _enter_window(self, keys: list[torch.Tensor]) -> None:
        if self._presubmitted:
            expected = self._presubmitted[0].keys
            if any(a is not b and not torch.equal(a, b) for a, b in zip(expected, keys)):
                # Refused before anything changes: the batch submitted ahead stays first.
                raise RuntimeError(
                    "the batch entering input_dist is not the batch submitted ahead for this "
                    "step (by BagPipeTrainPipeline, or by a training forward refused while an "
                    "earlier forward waited for its backward); feed the model the same "
                    "batches in the same order"
                )
            self._presubmitted.popleft()
            return
        if self._held is not None:
            self._held.append(keys)
            return
        self._submit(keys)

    def close_forward(self, what: str, park: Sequence[torch.Tensor] | None = None) -> None:
        """Before `what` (a training forward, a load): finishes with a zero gradient the
        pending steps of a forward whose backward already ran (their gradients cannot come);
        raises RuntimeError if a forward still waits for its backward. `park`: the refused
        forward's submitted batch, kept as submitted ahead (the same batch may enter again)."""
        fwd = self._forward
        if fwd is None or not any(self._pending):
            self._forward = None
            return
        if fwd.backward_seen:
            self.finish_pending()
            return
        if park is not None:
            self._presubmitted.appendleft(_Ahead((), [], list(park)))
        g = next(i for i, p in enumerate(self._pending) if p)
        raise RuntimeError(
            f"{what} while a training forward still waits for its backward (BagPipe fused "
            f"table {self.runtimes[g].name!r}, step {self._pending[g][0].step}): run that "
            "backward first, or finish the step with a zero gradient (the fused optimizer's "
            "step(), or flush())"
            + ("; this batch stays submitted: call the module with it again" if park else "")
        )

    def _train_rows(self, keys: Sequence[torch.Tensor]) -> list[BatchRows]:
        self.close_forward("a training forward", park=keys)
        fwd = _Forward()
        self._forward = fwd
        for g, (rt, k) in enumerate(zip(self.runtimes, keys)):
            step = train_step(rt, k)
            self._pending[g].append(step)
            fwd.steps.append(step)
        if not torch.is_grad_enabled():
            # Submitted by an input_dist with autograd enabled, computed without: the steps
            # cannot get a gradient; they commit a zero gradient now.
            self.finish_pending()
            return [BatchRows(step.rows.detach(), step.inverse) for step in fwd.steps]
        out = []
        for g, step in enumerate(fwd.steps):
            rows = step.rows
            if not rows.requires_grad:
                rows.requires_grad_(True)
            rows.register_hook(functools.partial(self._on_rows_grad, fwd, g, step))
            out.append(BatchRows.of_step(step))
        return out

    def _on_rows_grad(self, fwd: _Forward, g: int, step: Step, grad: torch.Tensor) -> None:
        pending = self._pending[g]
        if not pending or pending[0] is not step:
            raise RuntimeError(
                f"BagPipe fused table {self.runtimes[g].name!r}: a gradient arrived for step "
                f"{step.step}, which is already finished (backward ran twice through one "
                "forward, or the step was finished with a zero gradient before its backward: "
                "the fused optimizer's step(), flush() or close())"
            )
        # Whatever happens to this gradient, the forward's backward ran (invariant 2).
        fwd.backward_seen = True
        self.optimizer.finish(g, step, grad.detach())

    def _finish(self, g: int, step: Step, grad: torch.Tensor, lr: float) -> None:
        pending = self._pending[g]
        assert pending and pending[0] is step
        if self.config.check_finite_grads:
            # Before anything is committed; the step stays pending if it raises.
            check_finite_grad(grad, self._job.control, table=self.runtimes[g].name,
                              step=step.step)
        pending.popleft()
        self.runtimes[g].finish_step(step, grad, lr)

    def finish_pending(self) -> None:
        """Finishes, with a zero gradient, every step that received none (through the
        fused optimizer: at the step's learning rate): an explicit end of step."""
        for g, pending in enumerate(self._pending):
            while pending:
                step = pending[0]
                self.optimizer.finish(g, step, torch.zeros_like(
                    step.rows.detach(), memory_format=torch.contiguous_format))
        self._forward = None


def agreed_layout(
    configs: Sequence[BaseEmbeddingConfig],
    embedding_names: Sequence[Sequence[str]],
    optimizers: Mapping[str, TableOptimizer],
    *,
    env: ShardingEnv,
    device: torch.device,
    config: BagPipeConfig,
    module_fqn: str,
    weighted: bool,
    where: str,
    problem: BaseException | None,
) -> tuple[BagPipeJob, FusedLayout]:
    """The job and the layout of a module's BagPipe tables, agreed by every rank before
    anything opens on the PS (a collective on the job's control group, agreement.py).

    `embedding_names`: per table, its features' output keys as the whole module names them
    (a feature shared with a stock table is still `feature@table`); `optimizers`: each
    table's optimizer and initial learning rate (`table_optimizer.table_optimizer`, read
    before TorchRec's sharders see the module: see sharded_module.py); `weighted`: whether
    bags take per-id weights; `where`: names the module in error messages.

    `problem`: this rank's own set-up error so far (a bad plan, an unsupported optimizer), or
    None. A rank's own mistakes are not raised alone: every rank hears of them through the
    agreement and raises together (`SpecMismatchError` naming the rank and its error), as it
    does on any difference in tables, settings or deployment.
    """
    try:
        job = job_for(config, env, device)
    except ValueError as e:
        # This module's deployment differs from the process's job: the other ranks hear of
        # it (or of this rank's earlier mistake) through the job's control group.
        current = BagPipeJob.current()
        if current is None:
            raise (problem or e) from None
        agree_before_open(current.control, None, where=where, error=problem or e)
        raise
    layout: FusedLayout | None = None
    if problem is None:
        try:
            layout = FusedLayout(
                table_specs(configs, optimizers), embedding_names,
                session=job.next_session_id(), module_fqn=module_fqn, weighted=weighted,
                where=where,
            )
        except Exception as e:
            problem = e
    agree_before_open(
        job.control,
        None if layout is None else describe(layout.tables, layout.fused, config,
                                             job.deployment()),
        where=where, error=problem,
    )
    assert layout is not None
    return job, layout


@dataclass
class _Forward:
    """The steps one training forward took (one per fused table, in order)."""

    steps: list[Step] = field(default_factory=list)
    backward_seen: bool = False  # a step of it received its gradient (invariant 2)


@dataclass
class _Ahead:
    """A batch submitted ahead by the pipeline, with the split `enter` can reuse."""

    signature: tuple[Any, ...]
    per_group: list[KeyedJaggedTensor]
    keys: list[torch.Tensor]


def _signature(features: KeyedJaggedTensor) -> tuple[Any, ...]:
    """A KJT's keys, stride and data tensors with their in-place versions (the tensors are
    held, so their identity cannot be reused while the signature lives)."""
    tensors = (features.values(), features.lengths_or_none(), features.offsets_or_none(),
               features.weights_or_none())
    return (tuple(features.keys()), features.stride(),
            *((t, t._version) if t is not None else (None, 0) for t in tensors))


def _same_data(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two signatures name the same, unmodified tensors (TorchRec's CPU device copy
    of a batch keeps them), so the split computed ahead can be reused without a compare."""
    if a[:2] != b[:2]:
        return False
    return all(x[0] is y[0] and x[1] == y[1] for x, y in zip(a[2:], b[2:]))
