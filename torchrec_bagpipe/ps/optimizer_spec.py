"""`OptimizerSpec`: the update rule of a PS table's rows, and Adam's step size.

`OptimizerSpec` names the optimizer an `EmbeddingStore` (every table of a PS shard, every
trainer cache of that table) applies to its rows (``sgd``, ``adagrad``, ``rowwise_adagrad``,
``adam``) and its constants, checked once here; `native()` hands it to the store
(``C.OptimizerSpec``). The arithmetic itself is ``csrc/store/embedding_store.h`` (steps 1-10);
its torch-ops form, which the trainer caches run, is `torchrec_bagpipe.runtime.row_update`.
`adam_step_size` is the learning rate an Adam step's commit carries (the PS is
step-agnostic).

No torch at import (the server program reads specs before it imports torch).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from torchrec_bagpipe._native import C

if TYPE_CHECKING:
    import torch

__all__ = ["OPTIMIZER_KINDS", "OptimizerSpec", "adam_step_size"]


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

    def native(self) -> Any:
        """The spec as the store takes it (a ``C.OptimizerSpec``)."""
        o = C.OptimizerSpec()
        o.kind = self.kind
        o.eps = self.eps
        o.beta1 = self.beta1
        o.beta2 = self.beta2
        o.weight_decay = self.weight_decay
        o.initial_accumulator_value = self.initial_accumulator_value
        return o

    @classmethod
    def from_native(cls, o: Any) -> OptimizerSpec:
        """The spec of a ``C.OptimizerSpec`` (or of its dict form, as native stats give it)."""
        if isinstance(o, dict):
            return cls(**o)
        return cls(kind=o.kind, eps=o.eps, beta1=o.beta1, beta2=o.beta2,
                   weight_decay=o.weight_decay,
                   initial_accumulator_value=o.initial_accumulator_value)

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
        import torch  # the spec itself needs no torch (module docstring)

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
