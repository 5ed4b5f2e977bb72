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

Thread safety: the controller calls every method from the training thread, in step order:
``before_step(t)``, then (after the forward and backward) ``finish(t, plan, grad, lr)``;
``drain()`` between steps; ``close()`` once, last. A strategy may run work on the
communication worker (`worker.py`); it joins or cancels that work in ``before_step`` /
``drain`` / ``close``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from torchrec_bagpipe.runtime.access_plans import StepPlan

__all__ = ["Aggregation"]


class Aggregation(Protocol):
    def before_step(self, t: int) -> None:
        """Before step t reads any row: raises the error of a failed commit or worker task,
        and finishes the updates of earlier steps that step t's reads depend on."""
        ...

    def finish(self, t: int, plan: StepPlan, grad: torch.Tensor, lr: float) -> None:
        """Step t's row gradient (fp32 [U, dim], on the controller's device when it has a
        cache; borrowed: copied before it is kept) and learning rate: updates or invalidates
        the resident rows and submits the commit, which carries `lr`."""
        ...

    def drain(self) -> None:
        """Every commit submitted so far is committed and every local update applied
        (each wait bounded by the PS timeout)."""
        ...

    def close(self) -> None:
        """Cancels the work not started yet (after a failure); never waits."""
        ...
