"""The learning-rate policy of TorchRec's DLRM example (``--lr_warmup_steps``,
``--lr_decay_start``, ``--lr_decay_steps``), as its `LRPolicyScheduler` computes it.

It scales every param group's base learning rate by the step count t (1 when the scheduler
is built, +1 per `step()`):

* warm-up, t < W: ``1 - (W - t) / W`` (linear from 1/W);
* decay, S <= t < S + D: ``((D - (t - S)) / D) ** 2`` (quadratic), at least 1e-7 absolute;
* otherwise, with D > 0 the last computed value stays (frozen between warm-up and decay, and
  after the decay), with D = 0 the base learning rate.

One deviation: TorchRec's class fails (AttributeError) when D > 0, W = 0 and t < S, because
nothing has been computed yet; here the base learning rate applies. The decay must not start
before the warm-up ends (TorchRec's class exits; here ValueError).

Applied to a `CombinedOptimizer`, it sets the dense optimizer's groups and the embedding
tables' fused optimizer groups alike, as in TorchRec's example.
"""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LRScheduler

__all__ = ["MIN_DECAY_LR", "LRPolicyScheduler"]

MIN_DECAY_LR = 1e-7


class LRPolicyScheduler(LRScheduler):
    """Warm-up then quadratic decay of every param group's learning rate (module doc)."""

    def __init__(self, optimizer: Any, num_warmup_steps: int, decay_start_step: int,
                 num_decay_steps: int) -> None:
        if min(num_warmup_steps, decay_start_step, num_decay_steps) < 0:
            raise ValueError("warm-up steps, decay start and decay steps must be >= 0")
        if decay_start_step < num_warmup_steps:
            raise ValueError(
                f"learning rate warm-up ({num_warmup_steps} steps) must finish before the "
                f"decay starts (step {decay_start_step})"
            )
        self.num_warmup_steps = num_warmup_steps
        self.decay_start_step = decay_start_step
        self.num_decay_steps = num_decay_steps
        self.decay_end_step = decay_start_step + num_decay_steps
        self._policy_lrs: list[float] | None = None
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        t = self._step_count
        if t < self.num_warmup_steps:
            scale = 1.0 - (self.num_warmup_steps - t) / self.num_warmup_steps
            self._policy_lrs = [base * scale for base in self.base_lrs]
        elif self.decay_start_step <= t < self.decay_end_step:
            scale = ((self.num_decay_steps - (t - self.decay_start_step))
                     / self.num_decay_steps) ** 2
            self._policy_lrs = [max(MIN_DECAY_LR, base * scale) for base in self.base_lrs]
        elif self.num_decay_steps > 0 and self._policy_lrs is not None:
            return list(self._policy_lrs)
        else:
            return list(self.base_lrs)
        return list(self._policy_lrs)
