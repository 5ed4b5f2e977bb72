"""The PS's row update as torch ops: what a trainer cache applies to its resident rows.

`row_update` is the update of `ps.optimizer_spec.OptimizerSpec` written with torch ops, bit
for bit the arithmetic contract of ``csrc/store/embedding_store.h`` (steps 1-10): every step
is one torch op that rounds once in fp32, every constant is a float32 tensor on the rows'
device (a CPU scalar would let CUDA divide by a reciprocal), and no ``alpha=`` form is used
(it may fuse into a multiply-add). The square root is the one exception: torch's CPU float32
(and float64) sqrt is not correctly rounded (MKL / SLEEF kernels, about 1 result in 6 differs
from IEEE sqrt), so `sqrt32` takes it in float64 and rounds once to float32, which is the
IEEE float32 square root whenever the float64 one is within 4 ulp (a float32's square root
lies at least 4 float64 ulp from every float32 rounding boundary). A cache that applies
`row_update` to a row's summed gradient gets exactly the row the store computes, on CPU and
on CUDA (`device_cache.py` is its user).
"""

from __future__ import annotations

import numbers

import torch

from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

__all__ = ["row_update", "rowwise_sum", "sqrt32"]


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """The IEEE (correctly rounded) square root of a float32 tensor (see the module doc)."""
    return torch.sqrt(x.double()).float()


def rowwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Row sums of a 2-D float32 tensor over the store's fixed pairwise tree (step 7): the
    columns zero-padded to a power of two, then halves added until one column is left.
    Returns (n, 1)."""
    n, dim = x.shape
    width = 1
    while width < dim:
        width *= 2
    if width != dim:
        padded = torch.zeros((n, width), dtype=x.dtype, device=x.device)
        padded[:, :dim] = x
        x = padded
    while width > 1:
        width //= 2
        x = x[:, :width] + x[:, width:]
    return x


def row_update(
    w: torch.Tensor,
    state: torch.Tensor,
    g_sum: torch.Tensor,
    lr: float | torch.Tensor,
    divisor: int,
    spec: OptimizerSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One update of rows `w` (n, dim) with state `state` (n, state_dim) by their summed
    gradients `g_sum` (n, dim), all float32 on one device; returns the new (w, state)
    without modifying the inputs. `lr` is the step's learning rate (Adam: `adam_step_size`),
    rounded to float32 (a float32 tensor is used as it is); `divisor` the gradient divisor W.
    Bitwise equal to EmbeddingStore.apply_gradients on the same rows."""
    if w.dtype != torch.float32 or g_sum.dtype != torch.float32 or state.dtype != torch.float32:
        raise TypeError("w, state and g_sum must be float32")
    n, dim = w.shape
    if g_sum.shape != w.shape or state.shape != (n, spec.state_dim(dim)):
        raise ValueError(
            f"shapes: w {tuple(w.shape)}, g_sum {tuple(g_sum.shape)} and state "
            f"{tuple(state.shape)} do not fit dim {dim} and optimizer {spec.kind!r}"
        )
    if isinstance(divisor, bool) or not isinstance(divisor, numbers.Integral) or divisor < 1:
        raise ValueError(f"divisor must be an int >= 1, got {divisor!r}")
    device = w.device

    def const(value: float) -> torch.Tensor:
        return torch.full((), value, dtype=torch.float32, device=device)

    lr_t = lr.to(device=device, dtype=torch.float32) if isinstance(lr, torch.Tensor) else const(lr)
    u = g_sum
    if divisor != 1:  # step 2
        u = u / const(float(divisor))
    if spec.weight_decay != 0.0:  # step 3
        u = u + w * const(spec.weight_decay)
    eps = const(spec.eps)
    if spec.kind == "sgd":  # step 4
        return w - u * lr_t, state
    if spec.kind == "adagrad":  # step 5
        s = state + u * u
        d = sqrt32(s) + eps
        return w - (u / d) * lr_t, s
    if spec.kind == "rowwise_adagrad":  # steps 6-7
        r = rowwise_sum(u * u) / const(float(dim))
        s = state + r
        d = sqrt32(s) + eps
        m = lr_t / d
        return w - u * m, s
    # Adam, step 8: the state is [m | v].
    c1 = const(1.0 - spec.beta1)
    c2 = const(1.0 - spec.beta2)
    m0, v0 = state[:, :dim], state[:, dim:]
    m1 = m0 + (u - m0) * c1
    v1 = v0 + (u * u - v0) * c2
    d = sqrt32(v1) + eps
    return w - (m1 / d) * lr_t, torch.cat([m1, v1], dim=1)
