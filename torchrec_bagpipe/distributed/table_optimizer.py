"""Which optimizer a BagPipe table trains with, from every way TorchRec users say it.

TorchRec sets an embedding table's optimizer in two ways, both read here (one parser for
every BagPipe-sharded module kind):

* ``fused_params`` of the sharder: ``{"optimizer": EmbOptimType..., "learning_rate", "eps",
  "beta1", "beta2", "weight_decay", "weight_decay_mode", ...}`` with fbgemm's defaults;
* ``apply_optimizer_in_backward(cls, params, kwargs)`` on the table's parameter (it wins over
  ``fused_params``): the class's own defaults and keyword arguments.

Supported (`SUPPORTED`), as the PS's optimizers (`ps.optimizer_spec.OptimizerSpec`): SGD
(``EXACT_SGD`` / ``SGD``, `torch.optim.SGD`, `torchrec.optim.SGD`), Adagrad
(``EXACT_ADAGRAD`` / ``ADAGRAD``, `torch.optim.Adagrad`, `torchrec.optim.Adagrad`), row-wise
Adagrad (``EXACT_ROWWISE_ADAGRAD`` / ``ROWWISE_ADAGRAD``, `torchrec.optim.RowWiseAdagrad`),
lazy Adam (``ADAM``, `torch.optim.Adam`, `torch.optim.SparseAdam`, `torchrec.optim.Adam`).
Weight decay is L2 (added to the gradient), as torch's optimizers and fbgemm's
``WeightDecayMode.L2`` define it. Anything else (LAMB, LARS, momentum SGD, Adagrad's
``lr_decay``, AMSGrad, decoupled weight decay, ``maximize``, ...) is an
`UnsupportedOptimizerError` at sharding time, naming what is supported.

It also knows TorchRec's optimizer-state layout (`state_keys` / `state_entries`): stock
TorchRec's fused optimizer exposes a table's state as ``state[param]["<table>.momentum1"]``
(Adagrad: rows x dim; row-wise Adagrad: one value per row, 1-D) and, for Adam,
``"<table>.exp_avg_sq"`` (fbgemm's second moment); the PS keeps them as the row's state
columns (csrc/store/optimizer.h).

Pure functions of their arguments: no PS, no process group.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec

__all__ = [
    "SUPPORTED",
    "TableOptimizer",
    "UnsupportedOptimizerError",
    "state_entries",
    "state_floats",
    "state_keys",
    "table_optimizer",
]

SUPPORTED = (
    "fused_params optimizer EmbOptimType.EXACT_SGD / SGD, EXACT_ADAGRAD / ADAGRAD, "
    "EXACT_ROWWISE_ADAGRAD / ROWWISE_ADAGRAD or ADAM; apply_optimizer_in_backward with "
    "torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam, torch.optim.SparseAdam, "
    "torchrec.optim.RowWiseAdagrad (or torchrec.optim's SGD, Adagrad, Adam)"
)


class UnsupportedOptimizerError(ValueError):
    """The embedding optimizer is not one BagPipe's PS applies exactly."""


@dataclass(frozen=True)
class TableOptimizer:
    """A table's optimizer on the PS and its initial learning rate (a param group's ``lr``;
    an LR scheduler may change it every step)."""

    spec: OptimizerSpec
    lr: float


# EmbOptimType names (upper case) -> the PS's kinds.
_EMB_OPT_TYPES = {
    "SGD": "sgd",
    "EXACT_SGD": "sgd",
    "ADAGRAD": "adagrad",
    "EXACT_ADAGRAD": "adagrad",
    "ROWWISE_ADAGRAD": "rowwise_adagrad",
    "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad",
    "ROW_WISE_ADAGRAD": "rowwise_adagrad",  # (the enum's values, as strings)
    "EXACT_ROW_WISE_ADAGRAD": "rowwise_adagrad",
    "ADAM": "adam",
}

# fused_params keys that configure the optimizer; others that change nothing BagPipe does.
_OPTIMIZER_KEYS = {"optimizer", "learning_rate", "lr", "eps", "beta1", "beta2", "weight_decay",
                   "weight_decay_mode", "momentum"}
_NEUTRAL_FUSED_KEYS = {"output_dtype", "cache_load_factor", "prefetch_pipeline",
                       "stochastic_rounding", "bounds_check_mode"}


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be finite, got {value}")
    return value


def _spec(where: str, **fields: Any) -> OptimizerSpec:
    """An OptimizerSpec; a bad field is a ValueError naming the table and the field."""
    try:
        return OptimizerSpec(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _kind_of_emb_opt(opt: Any, where: str) -> str:
    name = str(getattr(opt, "name", opt)).upper()
    name = name.removeprefix("EMBOPTIMTYPE.")
    kind = _EMB_OPT_TYPES.get(name)
    if kind is None:
        raise UnsupportedOptimizerError(
            f"{where}: fused_params optimizer {opt!r} is not supported by BagPipe; "
            f"supported: {SUPPORTED}"
        )
    return kind


def _from_fused_params(fused: Mapping[str, Any], where: str) -> TableOptimizer | None:
    """The optimizer fused_params describe (fbgemm's defaults), or None without a learning
    rate. Raises for keys and values BagPipe cannot apply."""
    for key in fused:
        if key not in _OPTIMIZER_KEYS and key not in _NEUTRAL_FUSED_KEYS:
            raise UnsupportedOptimizerError(
                f"{where}: fused_params key {key!r} is not supported by BagPipe (supported: "
                f"{sorted(_OPTIMIZER_KEYS | _NEUTRAL_FUSED_KEYS)})"
            )
    kind = _kind_of_emb_opt(fused["optimizer"], where) if "optimizer" in fused else "sgd"
    if fused.get("momentum"):
        raise UnsupportedOptimizerError(
            f"{where}: fused_params momentum={fused['momentum']!r} is not supported (momentum "
            f"SGD); supported: {SUPPORTED}"
        )
    weight_decay = _number(fused.get("weight_decay", 0.0), "weight_decay", where)
    mode = fused.get("weight_decay_mode")
    mode_name = str(getattr(mode, "name", mode)).upper() if mode is not None else "NONE"
    if mode_name not in ("NONE", "L2"):
        raise UnsupportedOptimizerError(
            f"{where}: fused_params weight_decay_mode={mode!r} is not supported; BagPipe "
            "applies L2 weight decay (WeightDecayMode.L2)"
        )
    if weight_decay and mode_name != "L2":
        raise UnsupportedOptimizerError(
            f"{where}: fused_params weight_decay={weight_decay} without "
            "weight_decay_mode=WeightDecayMode.L2 (fbgemm would ignore it); pass "
            "weight_decay_mode=WeightDecayMode.L2 or leave weight_decay out"
        )
    lr = fused.get("learning_rate", fused.get("lr"))
    if lr is None:
        return None
    spec = _spec(
        where,
        kind=kind,
        eps=_number(fused.get("eps", 1e-8), "eps", where),
        beta1=_number(fused.get("beta1", 0.9), "beta1", where),
        beta2=_number(fused.get("beta2", 0.999), "beta2", where),
        weight_decay=weight_decay if mode_name == "L2" else 0.0,
    )
    return TableOptimizer(spec, _number(lr, "learning_rate", where))


def _optimizer_classes() -> dict[type, tuple[str, dict[str, Any], dict[str, Any]]]:
    """Supported classes -> (kind, their defaults, arguments that must keep their neutral
    value). torchrec.optim's wrappers take torch's defaults."""
    import torchrec.optim as trec_optim

    sgd = ("sgd", {"lr": 0.001, "weight_decay": 0.0},
           {"momentum": 0, "dampening": 0, "nesterov": False, "maximize": False})
    adagrad = ("adagrad", {"lr": 0.01, "weight_decay": 0.0, "initial_accumulator_value": 0.0,
                           "eps": 1e-10},
               {"lr_decay": 0, "maximize": False})
    rowwise = ("rowwise_adagrad", {"lr": 0.01, "weight_decay": 0.0,
                                   "initial_accumulator_value": 0.0, "eps": 1e-10},
               {"lr_decay": 0, "maximize": False})
    adam = ("adam", {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
            {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False})
    sparse_adam = ("adam", {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8},
                   {"maximize": False})
    return {
        torch.optim.SGD: sgd,
        trec_optim.SGD: sgd,
        torch.optim.Adagrad: adagrad,
        trec_optim.Adagrad: adagrad,
        trec_optim.RowWiseAdagrad: rowwise,
        torch.optim.Adam: adam,
        trec_optim.Adam: adam,
        torch.optim.SparseAdam: sparse_adam,
    }


# Keyword arguments of the supported classes that change nothing BagPipe computes.
_NEUTRAL_KWARGS = {"foreach", "fused", "differentiable", "capturable"}


def _from_in_backward(param: torch.Tensor, where: str) -> TableOptimizer | None:
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs_list = getattr(param, "_optimizer_kwargs", None)
    if len(classes) != 1:
        raise UnsupportedOptimizerError(
            f"{where}: {len(classes)} in-backward optimizers are applied; BagPipe supports "
            f"exactly one ({SUPPORTED})"
        )
    cls = classes[0]
    table = _optimizer_classes().get(cls)
    if table is None:
        raise UnsupportedOptimizerError(
            f"{where}: apply_optimizer_in_backward({getattr(cls, '__name__', cls)}) is not "
            f"supported by BagPipe; supported: {SUPPORTED}"
        )
    kind, defaults, neutral = table
    kwargs = dict(kwargs_list[0]) if kwargs_list else {}
    # TorchRec's stock sharders rewrite the kwargs in place (`apply_optimizer_in_backward`
    # shares one dict between the tables it is given, so a table sharded stock may have
    # rewritten a BagPipe table's): they add the EmbOptimType they chose and rename ``lr``
    # to ``learning_rate`` (torchrec.distributed.utils.merge_fused_params).
    if "learning_rate" in kwargs and "lr" not in kwargs:
        kwargs["lr"] = kwargs.pop("learning_rate")
    if "optimizer" in kwargs:
        chosen = _kind_of_emb_opt(kwargs.pop("optimizer"), where)
        if chosen != kind:
            raise UnsupportedOptimizerError(
                f"{where}: the in-backward {cls.__name__} was rewritten to {chosen}"
            )
    values = dict(defaults)
    for key, value in kwargs.items():
        if key in defaults:
            values[key] = value
        elif key in neutral:
            if value != neutral[key]:
                raise UnsupportedOptimizerError(
                    f"{where}: {cls.__name__}({key}={value!r}) is not supported by BagPipe "
                    f"(it needs {key}={neutral[key]!r}); supported: {SUPPORTED}"
                )
        elif key not in _NEUTRAL_KWARGS:
            raise UnsupportedOptimizerError(
                f"{where}: {cls.__name__} argument {key}={value!r} is not supported by BagPipe"
            )
    betas = values.get("betas", (0.9, 0.999))
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: {cls.__name__} betas must be a pair, got {betas!r}")
    spec = _spec(
        where,
        kind=kind,
        eps=_number(values.get("eps", 1e-8), "eps", where),
        beta1=_number(betas[0], "betas[0]", where),
        beta2=_number(betas[1], "betas[1]", where),
        weight_decay=_number(values.get("weight_decay", 0.0), "weight_decay", where),
        initial_accumulator_value=_number(values.get("initial_accumulator_value", 0.0),
                                          "initial_accumulator_value", where),
    )
    if "lr" not in kwargs:
        raise UnsupportedOptimizerError(
            f"{where}: apply_optimizer_in_backward({cls.__name__}) needs 'lr'")
    return TableOptimizer(spec, _number(values["lr"], "lr", where))


def table_optimizer(param: torch.Tensor | None, fused_params: Mapping[str, Any] | None,
                    where: str) -> TableOptimizer:
    """The optimizer and initial learning rate of one table: its in-backward optimizer when
    `param` has one, else `fused_params`. Raises UnsupportedOptimizerError for anything the
    PS cannot apply exactly (naming what is supported), ValueError for a bad value or when no
    learning rate is given at all."""
    # fused_params are checked even when an in-backward optimizer wins (a typo is an error).
    from_fused = _from_fused_params(fused_params or {}, where)
    chosen = _from_in_backward(param, where) if param is not None else None
    if chosen is None:
        chosen = from_fused
    if chosen is None:
        raise ValueError(
            f"{where}: no learning rate for the embedding optimizer; pass "
            "fused_params={'learning_rate': lr, ...} to the BagPipe sharder or "
            "apply_optimizer_in_backward(<optimizer>, params, {'lr': lr}) before sharding"
        )
    if not chosen.lr > 0.0:
        # The configured rate; a schedule may later take a step's rate down to 0.
        raise ValueError(f"{where}: the embedding learning rate must be > 0, got {chosen.lr}")
    return chosen


def state_floats(param: torch.Tensor | None, fused_params: Mapping[str, Any] | None,
                 dim: int, where: str) -> int:
    """Optimizer state floats per row of a table (for memory estimates while planning): an
    unsupported optimizer raises as `table_optimizer`; a table whose optimizer is not fully
    given yet (no learning rate) counts as SGD."""
    try:
        return table_optimizer(param, fused_params, where).spec.state_dim(dim)
    except UnsupportedOptimizerError:
        raise
    except ValueError:
        return 0


# ---- TorchRec's optimizer-state layout ----------------------------------------------------------
def state_keys(spec: OptimizerSpec) -> tuple[str, ...]:
    """The state entries stock TorchRec names for a table of this optimizer (without the
    ``<table>.`` prefix), in the PS's column order."""
    return {"sgd": (), "adagrad": ("momentum1",), "rowwise_adagrad": ("momentum1",),
            "adam": ("momentum1", "exp_avg_sq")}[spec.kind]


def state_entries(spec: OptimizerSpec, dim: int) -> dict[str, tuple[int, int, bool]]:
    """Where TorchRec's state entries of a table sit among the PS's state columns of a row:
    entry -> (first column, end column, vector). ``momentum1`` is [rows, dim] (row-wise
    Adagrad: one value per row, a vector [rows]); Adam's ``exp_avg_sq`` [rows, dim] follows."""
    if spec.kind == "rowwise_adagrad":
        return {"momentum1": (0, 1, True)}
    return {k: (i * dim, (i + 1) * dim, False) for i, k in enumerate(state_keys(spec))}
