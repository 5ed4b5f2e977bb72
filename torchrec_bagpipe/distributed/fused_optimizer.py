"""The fused SGD optimizer of a BagPipe-sharded EmbeddingBagCollection.

Like TorchRec's fused TBE optimizers, the update happens during backward: autograd yields
each fused table's |U| x dim row gradient, and this optimizer hands it to the runtime
(`BagPipeController.finish_step`), which commits it to the PS (the PS applies SGD once per
step) and keeps the rank's cache coherent. `step()` only finishes steps whose rows received
no gradient (their loss did not depend on them): they commit a zero gradient so every rank
advances the same step sequence.

Only constant-learning-rate plain SGD is supported; the learning rate lives in the param
groups (one per fused table) so TorchRec's CombinedOptimizer and LR schedulers see it, and
any change of it is refused with a clear error at the next commit.

Thread-safety: driven by the rank's training thread and its autograd thread, which never
run concurrently for one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchrec.optim.fused import FusedOptimizer

__all__ = ["BagPipeFusedOptimizer", "UnsupportedOptimizerError", "sgd_lr_from"]

# Keyword arguments of torch.optim.SGD that keep it plain SGD, with their neutral values.
_NEUTRAL_SGD_KWARGS: dict[str, Any] = {
    "momentum": 0,
    "dampening": 0,
    "weight_decay": 0,
    "nesterov": False,
    "maximize": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}

# fused_params keys of TorchRec's fused kernels that keep it plain SGD.
_NEUTRAL_FUSED_KEYS = {
    "optimizer",
    "learning_rate",
    "lr",
    "weight_decay",
    "momentum",
    "output_dtype",
    "cache_load_factor",
    "prefetch_pipeline",
    "stochastic_rounding",
    "bounds_check_mode",
}


class UnsupportedOptimizerError(ValueError):
    """The embedding optimizer is not constant-learning-rate plain SGD."""


def _sgd_from_fused_params(fused_params: Mapping[str, Any], where: str) -> float | None:
    if not fused_params:
        return None
    opt = fused_params.get("optimizer")
    if opt is not None:
        name = getattr(opt, "name", str(opt)).upper()
        if name not in ("SGD", "EXACT_SGD", "EMBOPTIMTYPE.SGD", "EMBOPTIMTYPE.EXACT_SGD"):
            raise UnsupportedOptimizerError(
                f"{where}: fused_params optimizer {opt!r} is not supported; BagPipe trains "
                "embeddings with constant-learning-rate SGD only (EmbOptimType.EXACT_SGD)"
            )
    for key in ("weight_decay", "momentum"):
        if fused_params.get(key):
            raise UnsupportedOptimizerError(
                f"{where}: fused_params {key}={fused_params[key]!r} is not supported; "
                "BagPipe trains embeddings with plain SGD only"
            )
    lr = fused_params.get("learning_rate", fused_params.get("lr"))
    if lr is None:
        return None
    return float(lr)


def _sgd_from_param(param: torch.Tensor, where: str) -> float | None:
    classes = getattr(param, "_optimizer_classes", None)
    kwargs_list = getattr(param, "_optimizer_kwargs", None)
    if not classes:
        return None
    if len(classes) != 1:
        raise UnsupportedOptimizerError(
            f"{where}: {len(classes)} in-backward optimizers are applied; BagPipe supports "
            "exactly one (torch.optim.SGD)"
        )
    cls = classes[0]
    kwargs = dict(kwargs_list[0]) if kwargs_list else {}
    if cls is not torch.optim.SGD:
        raise UnsupportedOptimizerError(
            f"{where}: apply_optimizer_in_backward({getattr(cls, '__name__', cls)}) is not "
            "supported; BagPipe trains embeddings with constant-learning-rate torch.optim.SGD"
        )
    if "lr" not in kwargs:
        raise UnsupportedOptimizerError(f"{where}: apply_optimizer_in_backward(SGD) needs 'lr'")
    for key, value in kwargs.items():
        if key == "lr":
            continue
        if key == "optimizer":  # added in place by TorchRec's stock sharder
            _sgd_from_fused_params({"optimizer": value}, where)
            continue
        if key not in _NEUTRAL_SGD_KWARGS:
            raise UnsupportedOptimizerError(
                f"{where}: SGD argument {key}={value!r} is not supported by BagPipe"
            )
        if value != _NEUTRAL_SGD_KWARGS[key] and key not in ("foreach", "fused"):
            raise UnsupportedOptimizerError(
                f"{where}: SGD {key}={value!r} is not supported; BagPipe trains embeddings "
                "with plain SGD (no momentum, dampening, weight decay, nesterov or maximize)"
            )
    lr = kwargs["lr"]
    if isinstance(lr, torch.Tensor):
        lr = lr.item()
    return float(lr)


def sgd_lr_from(
    param: torch.Tensor | None, fused_params: Mapping[str, Any] | None, where: str
) -> float:
    """The SGD learning rate for one table: apply_optimizer_in_backward first, then
    fused_params. Raises UnsupportedOptimizerError for anything but plain SGD and
    ValueError when no learning rate is given at all."""
    for key in (fused_params or {}):
        if key not in _NEUTRAL_FUSED_KEYS:
            raise UnsupportedOptimizerError(
                f"{where}: fused_params key {key!r} is not supported by BagPipe (supported: "
                f"{sorted(_NEUTRAL_FUSED_KEYS)})"
            )
    from_fused = _sgd_from_fused_params(fused_params or {}, where)
    from_param = _sgd_from_param(param, where) if param is not None else None
    lr = from_param if from_param is not None else from_fused
    if lr is None:
        raise ValueError(
            f"{where}: no learning rate for the embedding optimizer; pass "
            "fused_params={'learning_rate': lr} to BagPipeEmbeddingBagCollectionSharder or "
            "apply_optimizer_in_backward(torch.optim.SGD, params, {'lr': lr}) before sharding"
        )
    if not lr > 0.0:
        raise ValueError(f"{where}: the embedding learning rate must be > 0, got {lr}")
    return lr


class BagPipeFusedOptimizer(FusedOptimizer):
    """KeyedOptimizer face of the fused SGD (one param group per fused table).

    `finish(group, step, grad)` is called from the rows' backward hook; `step()` finishes
    the steps that got no gradient. `state` is empty: SGD keeps none.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        groups: list[tuple[str, float, list[torch.Tensor]]],
        finish_fn: Callable[[int, Any, torch.Tensor], None],
        pending_fn: Callable[[], None],
    ) -> None:
        param_groups = [
            {"params": list(tensors), "lr": lr, "fused_table": name}
            for (name, lr, tensors) in groups
        ]
        super().__init__(params, {}, param_groups)
        self._lrs = [lr for (_, lr, _) in groups]
        self._names = [name for (name, _, _) in groups]
        self._finish_fn = finish_fn
        self._pending_fn = pending_fn

    def check_lr(self, group: int) -> float:
        """The fused table's learning rate; refuses any change made through param_groups."""
        current = float(list(self.param_groups)[group]["lr"])
        if current != self._lrs[group]:
            raise UnsupportedOptimizerError(
                f"the learning rate of BagPipe fused table {self._names[group]!r} changed from "
                f"{self._lrs[group]} to {current}; BagPipe trains embeddings with "
                "constant-learning-rate SGD (the PS applies the session's fixed lr)"
            )
        return current

    def finish(self, group: int, step: Any, grad: torch.Tensor) -> None:
        self.check_lr(group)
        self._finish_fn(group, step, grad)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for g in range(len(self._lrs)):
            self.check_lr(g)
        self._pending_fn()

    def zero_grad(self, set_to_none: bool = False) -> None:
        return None
