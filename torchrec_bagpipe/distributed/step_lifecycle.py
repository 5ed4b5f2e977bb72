"""`StepLifecycle`: how the batches of one sharded module's BagPipe tables become steps.

One per `BagPipeTables` (bagpipe_tables.py), over its fused tables' runtimes
(fused_table_runtime.py). It owns the lookahead submissions (`presubmit`,
`hold_submissions`), the batch entering `input_dist` (`enter`), the rows a batch reads
(`batch_rows`: the runtime's next step of every fused table in training, the PS in eval,
as `types.BatchRows`), and pending steps and their finishes.

Thread-safety: one training thread per rank (the autograd thread runs the backward hook
while that thread waits in backward).

A training forward (module training, autograd enabled) takes one step of every fused
table; the step is *pending* until its rows' gradient arrives in backward (the hook hands it
to the fused table's runtime, which commits it) or until an explicit end of step finishes it
with a zero gradient: the fused optimizer's `step()` (a step whose loss did not depend on its
rows), `flush()`, `close()`. Between a training forward and its backward:

* reads of the live state-dict tensors and eval forwards see the weights as of the last
  finished step (the commits of finished steps drained; the pending step stays pending, as
  stock TorchRec's fused update has not run either);
* a write (a state-dict or optimizer-state load) raises RuntimeError before writing anything
  (its rows would be overwritten under the pending step's gradient): `close_forward`;
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
   of step or after that forward's backward ran (above); every finish goes through the fused
   table's runtime, which commits it at the step's learning rate (its `StepLearningRate`:
   the fused optimizer's param group).
3. A batch is submitted to every fused table or to none: all are checked (`check_submit`)
   before the first submission; a submission failing after that leaves the module broken
   (`broken`: every later call raises).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.distributed.fused_table_runtime import FusedTableRuntime
from torchrec_bagpipe.distributed.grad_check import check_finite_grad
from torchrec_bagpipe.distributed.layout import FusedLayout
from torchrec_bagpipe.distributed.types import BatchRows

if TYPE_CHECKING:
    import torch.distributed as dist

    from torchrec_bagpipe.runtime.controller import Step

__all__ = ["StepLifecycle"]


class StepLifecycle:
    """The step lifecycle of one module's fused tables (see module docstring).

    Args:
        layout: the module's BagPipe layout (KJT -> fused keys).
        runtimes: one per fused table, in layout order.
        device: where batch rows land.
        control: the job's control group (the finite-gradient check's vote), or None
            without that check (`BagPipeConfig.check_finite_grads` off).
    """

    def __init__(self, layout: FusedLayout, runtimes: Sequence[FusedTableRuntime], *,
                 device: torch.device, control: dist.ProcessGroup | None) -> None:
        self._layout = layout
        self._runtimes = list(runtimes)
        self._device = device
        self._control = control
        self._presubmitted: deque[_Ahead] = deque()
        self._held: list[list[torch.Tensor]] | None = None
        self._pending: list[deque[Step]] = [deque() for _ in self._runtimes]
        self._forward: _Forward | None = None  # the outstanding training forward
        self.broken: BaseException | None = None  # invariant 3

    # ---- a batch entering the module -------------------------------------------------------
    def enter(self, features: KeyedJaggedTensor, training: bool
              ) -> tuple[list[KeyedJaggedTensor], list[torch.Tensor]]:
        """`input_dist` of one batch: per fused table, the KJT in slot order and its fused
        keys. A training batch enters the runtime's window: it is submitted, or checked to
        be the batch `presubmit` submitted ahead, or held (`hold_submissions`)."""
        ahead = self._presubmitted[0] if training and self._presubmitted else None
        if ahead is not None and _same_data(ahead.signature, _signature(features)):
            # The very tensors submitted ahead (not modified since): reuse their split.
            per_group, keys = ahead.per_group, ahead.keys
        else:
            per_group, keys = self._layout.split(features)
        if training:
            self._enter_window(keys)
        return per_group, keys

    def batch_rows(self, keys: Sequence[torch.Tensor], training: bool) -> list[BatchRows]:
        """The rows a batch of fused `keys` (one tensor per fused table) reads from each
        fused table: in training (the batch was submitted) the runtime's next step of every
        fused table (leaves whose gradients commit the steps), otherwise the PS after the
        commits of every finished step (module docstring)."""
        if training:
            return self._train_rows(keys)
        out = []
        for rt, k in zip(self._runtimes, keys):
            rows, inverse = rt.eval_rows(k)
            out.append(BatchRows(rows.to(self._device), inverse.to(self._device)))
        return out

    # ---- lookahead (BagPipeTrainPipeline) ------------------------------------------------------
    def presubmit(self, features: KeyedJaggedTensor) -> None:
        """Submits a future training batch to the runtime's lookahead window; `enter` of the
        same batch, later, then only checks it matches."""
        per_group, keys = self._layout.split(features)
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

    def _submit(self, keys: list[torch.Tensor]) -> None:
        """Submits one batch to every fused table, or to none (invariant 3)."""
        for rt, k in zip(self._runtimes, keys):
            rt.check_submit(k)
        done = 0
        try:
            for rt, k in zip(self._runtimes, keys):
                rt.submit(k)
                done += 1
        except BaseException as e:
            if done:
                self.broken = e
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

    # ---- pending steps -------------------------------------------------------------------------
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
            f"table {self._runtimes[g].name!r}, step {self._pending[g][0].step}): run that "
            "backward first, or finish the step with a zero gradient (the fused optimizer's "
            "step(), or flush())"
            + ("; this batch stays submitted: call the module with it again" if park else "")
        )

    def finish_pending(self) -> None:
        """Finishes, with a zero gradient, every step that received none (at the step's
        learning rate): an explicit end of step."""
        for g, pending in enumerate(self._pending):
            while pending:
                step = pending[0]
                self._finish(g, step, torch.zeros_like(
                    step.rows.detach(), memory_format=torch.contiguous_format))
        self._forward = None

    def _train_rows(self, keys: Sequence[torch.Tensor]) -> list[BatchRows]:
        self.close_forward("a training forward", park=keys)
        fwd = _Forward()
        self._forward = fwd
        for g, (rt, k) in enumerate(zip(self._runtimes, keys)):
            step = rt.next_step()
            if step.inverse.numel() != k.numel() or not torch.equal(step.keys, k):
                raise RuntimeError(
                    f"BagPipe fused table {rt.name!r}: the runtime's next step is not this "
                    "batch (steps must be consumed in submission order)"
                )
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
            out.append(BatchRows(step.rows, step.inverse))
        return out

    def _on_rows_grad(self, fwd: _Forward, g: int, step: Step, grad: torch.Tensor) -> None:
        pending = self._pending[g]
        if not pending or pending[0] is not step:
            raise RuntimeError(
                f"BagPipe fused table {self._runtimes[g].name!r}: a gradient arrived for step "
                f"{step.step}, which is already finished (backward ran twice through one "
                "forward, or the step was finished with a zero gradient before its backward: "
                "the fused optimizer's step(), flush() or close())"
            )
        # Whatever happens to this gradient, the forward's backward ran (invariant 2).
        fwd.backward_seen = True
        self._finish(g, step, grad.detach())

    def _finish(self, g: int, step: Step, grad: torch.Tensor) -> None:
        pending = self._pending[g]
        assert pending and pending[0] is step
        runtime = self._runtimes[g]
        if self._control is not None:
            # Before anything is committed; the step stays pending if it raises.
            check_finite_grad(grad, self._control, table=runtime.name, step=step.step)
        runtime.finish_step(step, grad)  # a bad lr raises first: the step stays pending
        pending.popleft()
        runtime.check_checkpoints()


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
