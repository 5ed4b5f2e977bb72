"""The opt-in check for non-finite embedding gradients (`BagPipeConfig.check_finite_grads`).

TorchRec does not look at gradients (neither does BagPipe by default: a NaN follows the
arithmetic). With the check on, each fused table's |U| x dim row gradient is tested before
its step is committed, and the ranks compare verdicts over the job's control group, so a
NaN or inf on one rank fails the step on every rank, naming the ranks, before any rank's
commit reaches the PS (no rank is left waiting `ps_timeout` for a commit that never comes).
The step stays pending: when the module next runs, it is finished with a zero gradient on
every rank (the batch's embedding update is dropped), or the job stops.

Thread-safety: called from the rank's autograd thread (the rows' backward hook) or its
training thread (gradient-less steps), never concurrently; every rank calls it once per
finished step of each fused table, in the same order (the step lifecycle of
`embeddingbag.py`), so the collectives pair up.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["NonFiniteGradientError", "check_finite_grad"]


class NonFiniteGradientError(FloatingPointError):
    """An embedding row gradient holds NaN or inf (the step was not committed)."""


class _Gather(Protocol):
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


def check_finite_grad(grad: torch.Tensor, collectives: _Gather, *, table: str,
                      step: int) -> None:
    """Raises NonFiniteGradientError on every rank if `grad` holds a NaN or inf on any rank
    (one all-gather of a count per rank)."""
    local = int((~torch.isfinite(grad)).sum().item()) if grad.numel() else 0
    counts = [int(c.reshape(-1)[0]) for c in
              collectives.all_gather(torch.tensor([local], dtype=torch.int64))]
    bad = {r: n for r, n in enumerate(counts) if n}
    if bad:
        where = ", ".join(f"rank {r}: {n}" for r, n in sorted(bad.items()))
        raise NonFiniteGradientError(
            f"BagPipe fused table {table!r}, step {step}: the embedding gradient holds "
            f"non-finite values (NaN/inf) ({where}); the step was not committed on any rank "
            "(BagPipeConfig.check_finite_grads)"
        )
