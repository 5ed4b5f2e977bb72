"""Aggregation: how a finished step's row gradients reach the PS and keep the cache coherent.

One interface (`Aggregation`, a Protocol both strategies subclass), two strategies, chosen by
`BagPipeConfig.bagpipe_aggregation`:

  * ``ps`` (`ps_aggregation.PSAggregation`): each rank commits its own unique-row gradients;
    the PS sums the ranks'. Resident rows only this rank touched are updated locally; rows
    another rank touched are invalidated.
  * ``collective`` (`collective_aggregation.CollectiveAggregation`): the ranks all-reduce the
    step's gradients over the global union of keys, every rank updates all its resident
    affected rows, and each union row's designated rank commits it.

Every local row update goes through `DeviceCache.apply_gradients_`, the one place that holds
the PS's optimizer arithmetic on the cache side, at the learning rate the step's commit
carries.

Each strategy splits a step's aggregation in two:

  * ``plan_finish(t, plan)``: the cache metadata effects of step t's aggregation (versions,
    invalidations, pins), a function of the plan alone (no gradient needed). It runs when
    step t is prepared (after step t's admission, before any later step is prepared: the
    step preparer, `step_preparer.py`), under the controller's cache lock, on whichever
    thread prepares the step; it returns what ``finish`` needs (slots, gather plans, keys).
  * ``finish(t, plan, grad, planned, lr)``: the tensor work once the gradient exists: local
    row updates (weights and optimizer state, at the step's learning rate) on the slots
    ``plan_finish`` chose, all-reduces and the commit, which carries ``lr``.

Thread safety: the controller calls ``before_step(t)``, ``finish``, ``drain`` and ``close``
from the training thread, in step order: ``before_step(t)`` before step t reads any row,
then (after the forward and backward) ``finish``; ``drain()`` between steps; ``close()``
once, last. ``plan_finish`` runs under the cache lock (see above). A strategy may run work on
the communication worker (`worker.py`); it joins or cancels that work in ``before_step`` /
``drain`` / ``close``. Row values are written only by ``before_step`` / ``finish`` (and the
worker tasks they start), never by ``plan_finish``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from torchrec_bagpipe.runtime.access_plans import StepPlan

__all__ = ["Aggregation"]


class Aggregation(Protocol):
    def before_step(self, t: int) -> None:
        """Before step t reads any row: raises the error of a failed commit or worker task,
        and finishes the updates of earlier steps that step t's reads depend on."""
        ...

    def plan_finish(self, t: int, plan: StepPlan) -> Any:
        """The metadata effects of step t's aggregation (versions, invalidations, pins), with
        the cache lock held, after step t's admission and before step t + 1 is prepared;
        returns what `finish` needs."""
        ...

    def finish(self, t: int, plan: StepPlan, grad: torch.Tensor, planned: Any,
               lr: float) -> None:
        """Step t's row gradient (fp32 [U, dim], on the controller's device when it has a
        cache; borrowed: copied before it is kept), `plan_finish`'s result and the learning
        rate: updates the resident rows it chose and submits the commit, which carries `lr`."""
        ...

    def drain(self) -> None:
        """Every commit submitted so far is committed and every local update applied
        (each wait bounded by the PS timeout)."""
        ...

    def close(self) -> None:
        """Cancels the work not started yet (after a failure); never waits."""
        ...
