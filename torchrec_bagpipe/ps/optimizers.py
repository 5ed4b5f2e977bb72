"""The optimizers of the embedding store, as a spec and as torch ops.

`OptimizerSpec` names the update rule of an `EmbeddingStore` (``sgd``, ``adagrad``,
``rowwise_adagrad``, ``adam``) and its hyper-parameters. `optimizer_step` is the same update
written with torch ops, bit for bit the arithmetic contract of ``csrc/store/embedding_store.h``
(steps 1-10): every step is one torch op that rounds once in fp32, every constant is a
float32 tensor on the rows' device (a CPU scalar would let CUDA divide by a reciprocal), and
no ``alpha=`` form is used (it may fuse into a multiply-add). The square root is the one
exception: torch's CPU float32 (and float64) sqrt is not correctly rounded (MKL / SLEEF
kernels, about 1 result in 6 differs from IEEE sqrt), so `sqrt32` takes it in float64 and
rounds once to float32, which is the IEEE float32 square root whenever the float64 one is
within 4 ulp (a float32's square root lies at least 4 float64 ulp from every float32
rounding boundary). A trainer cache that applies `optimizer_step` to a row's summed gradient
gets exactly the row the store computes, on CPU and on CUDA.

This module imports torch only (no native code), so the trainer side can use it anywhere.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "OPTIMIZER_KINDS",
    "OptimizerSpec",
    "adam_step_size",
    "optimizer_step",
    "rowwise_sum",
    "sqrt32",
]

OPTIMIZER_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def _f32(x: float) -> float:
    """x rounded once to float32 (as a Python float; inf past the float32 range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _nonnegative(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0 and math.isfinite(_f32(value))):
        raise ValueError(f"{name} must be finite and >= 0 (also as float32), got {value}")
    return value + 0.0  # -0.0 becomes 0.0, as in the store


def _beta(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


@dataclass(frozen=True)
class OptimizerSpec:
    """The update rule of a store's rows (see csrc/store/embedding_store.h, steps 1-10).

    ``weight_decay`` is L2 (added to the scaled gradient) for every kind. ``eps`` is used by
    the Adagrad kinds and Adam, ``initial_accumulator_value`` by the Adagrad kinds, ``beta1``
    and ``beta2`` by Adam. Invalid fields raise TypeError / ValueError naming the field.
    """

    kind: str = "sgd"
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZER_KINDS:
            raise ValueError(
                f"optimizer.kind must be one of {list(OPTIMIZER_KINDS)}, got {self.kind!r}"
            )
        set_ = object.__setattr__
        set_(self, "eps", _nonnegative(self.eps, "optimizer.eps"))
        set_(self, "beta1", _beta(self.beta1, "optimizer.beta1"))
        set_(self, "beta2", _beta(self.beta2, "optimizer.beta2"))
        set_(self, "weight_decay", _nonnegative(self.weight_decay, "optimizer.weight_decay"))
        set_(
            self,
            "initial_accumulator_value",
            _nonnegative(self.initial_accumulator_value, "optimizer.initial_accumulator_value"),
        )

    @classmethod
    def of(cls, value: OptimizerSpec | str | dict[str, Any]) -> OptimizerSpec:
        """A spec from a spec, a kind name, or a dict of fields (``{"kind": ..., ...}``)."""
        if isinstance(value, OptimizerSpec):
            return value
        if isinstance(value, str):
            return cls(kind=value)
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"optimizer: unknown field(s) {sorted(unknown)}")
            return cls(**value)
        raise TypeError(
            f"optimizer must be an OptimizerSpec, a kind name or a dict, got {type(value).__name__}"
        )

    def state_dim(self, dim: int) -> int:
        """Floats of state per row: SGD 0, Adagrad dim, row-wise Adagrad 1, Adam 2*dim."""
        return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim}[self.kind]

    @property
    def initial_state_value(self) -> float:
        """Every float of a fresh row's state (step 10), as float32."""
        if self.kind in ("adagrad", "rowwise_adagrad"):
            return _f32(self.initial_accumulator_value)
        return 0.0

    def initial_state(
        self, num_rows: int, dim: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The initial state of `num_rows` rows, (num_rows, state_dim(dim)) float32."""
        return torch.full(
            (num_rows, self.state_dim(dim)),
            self.initial_state_value,
            dtype=torch.float32,
            device=device,
        )


def adam_step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """Adam's bias-corrected step size lr*sqrt(1 - beta2^step)/(1 - beta1^step) for step >= 1,
    computed in double and rounded once to float32: what a caller passes as the store's `lr`
    for Adam (contract step 8; torch.optim.SparseAdam's step_size)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    bias1 = 1.0 - beta1 ** int(step)
    bias2 = 1.0 - beta2 ** int(step)
    return _f32(lr * math.sqrt(bias2) / bias1)


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


def optimizer_step(
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
