"""Model-level helpers: find BagPipe modules, prescan, metrics, clean shutdown."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_bagpipe.distributed.sharded_module import BagPipeShardedModule

__all__ = ["bagpipe_metrics", "bagpipe_modules", "close_model", "flush_model", "prescan_model"]


def bagpipe_modules(model: nn.Module) -> list[tuple[str, BagPipeShardedModule]]:
    """Every BagPipe-sharded EBC and EC in `model` (DMP, DDP or plain), by path."""
    seen: set[int] = set()
    found = []
    for name, m in model.named_modules():
        if isinstance(m, BagPipeShardedModule) and id(m) not in seen:
            seen.add(id(m))
            found.append((name, m))
    return found


def prescan_model(
    model: nn.Module,
    batches: Iterable[Any],
    features: Callable[[Any], KeyedJaggedTensor] | None = None,
) -> None:
    """Hands the whole training trace to the runtime before training (prescan mode).

    `batches` must be this rank's training batches, in training order; `features` maps a
    batch to the KJT the (single) BagPipe-sharded module receives (default: `batch.sparse_features`,
    TorchRec's `Batch`). Models with several BagPipe-sharded modules use `BagPipeTrainPipeline(...,
    prescan_batches=...)`, which finds each module's input itself.
    """
    modules = bagpipe_modules(model)
    if not modules:
        raise ValueError("prescan_model: the model has no BagPipe-sharded module")
    if len(modules) > 1:
        raise ValueError(
            "prescan_model: the model has several BagPipe-sharded modules "
            f"({[n for n, _ in modules]}); use BagPipeTrainPipeline(prescan_batches=...)"
        )
    get = features if features is not None else (lambda b: b.sparse_features)
    modules[0][1].prescan(get(b) for b in batches)


def bagpipe_metrics(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Runtime metrics of every fused table of every BagPipe-sharded module (by
    `path/fused table`)."""
    out: dict[str, dict[str, Any]] = {}
    for name, m in bagpipe_modules(model):
        for table, metrics in m.bagpipe_metrics().items():
            out[f"{name}/{table}" if name else table] = metrics
    return out


def flush_model(model: nn.Module) -> None:
    """Waits until every pending embedding commit of the model is applied on the PS."""
    for _, m in bagpipe_modules(model):
        m.flush()


def close_model(model: nn.Module) -> None:
    """Drains pending commits and closes every BagPipe-sharded module's PS sessions
    (idempotent)."""
    errors = []
    for _, m in bagpipe_modules(model):
        try:
            m.close()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]
