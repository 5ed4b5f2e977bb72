"""What TorchRec's stock fused kernels (fbgemm 1.8) can train, per device: the capability
step of the placement rule (placement.py).

fbgemm's `SplitTableBatchedEmbeddingBagsCodegen` asserts on its optimizer when it is built:
on CPU only EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD and EMAINPLACE_ROWWISE_ADAGRAD
("Optimizer adam is not supported in CPU mode"), and its CPU kernels train FP32 / FP16
weights only (a BF16 table fails). A table's embedding optimizer is its in-backward
optimizer (`apply_optimizer_in_backward`, mapped as TorchRec maps it) or else the sharder's
`fused_params["optimizer"]`; a table with neither trains with fbgemm's default, which every
device supports.

`stock_cannot_train` answers why the stock kernels cannot train a table on a device, or
None. Pure functions; no TorchRec state is read or changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType

__all__ = ["stock_cannot_train", "table_emb_optimizer"]

# fbgemm 1.8's split_table_batched_embeddings_ops_training: the optimizers its CPU and GPU
# kernels accept (upper-case EmbOptimType names; SGD and ROWWISE_ADAGRAD are deprecated in
# both modes and rejected too).
_CPU_OPTIMIZERS = frozenset({"EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD",
                             "EMAINPLACE_ROWWISE_ADAGRAD"})
_GPU_OPTIMIZERS = _CPU_OPTIMIZERS | {"ADAM", "LAMB", "LARS_SGD", "PARTIAL_ROWWISE_ADAM",
                                     "PARTIAL_ROWWISE_LAMB", "ENSEMBLE_ROWWISE_ADAGRAD",
                                     "NONE"}
_OPTIMIZERS = {"cpu": _CPU_OPTIMIZERS, "cuda": _GPU_OPTIMIZERS}
# Weight data types fbgemm's kernels train, per device.
_CPU_DTYPES = frozenset({DataType.FP32, DataType.FP16})
_DTYPES = {"cpu": _CPU_DTYPES, "cuda": frozenset({DataType.FP32, DataType.FP16,
                                                  DataType.BF16})}


def _name(opt: Any) -> str:
    return str(getattr(opt, "name", opt)).upper().removeprefix("EMBOPTIMTYPE.")


def table_emb_optimizer(param: torch.Tensor | None,
                        fused_params: Mapping[str, Any] | None) -> str | None:
    """The EmbOptimType name the stock kernels would build for a table: its in-backward
    optimizer class (as TorchRec maps it), else `fused_params["optimizer"]`, else None
    (fbgemm's default)."""
    classes = getattr(param, "_optimizer_classes", None) if param is not None else None
    if classes:
        from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

        try:
            opt = optimizer_type_to_emb_opt_type(classes[0])
        except ValueError:  # TorchRec cannot fuse it either
            return getattr(classes[0], "__name__", str(classes[0])).upper()
        return _name(opt) if opt is not None else None
    opt = (fused_params or {}).get("optimizer")
    return _name(opt) if opt is not None else None


def stock_cannot_train(cfg: BaseEmbeddingConfig, optimizer: str | None,
                       device: str) -> str | None:
    """Why TorchRec's stock fused kernels cannot train table `cfg` with `optimizer` (an
    EmbOptimType name or None) on `device` ("cpu", "cuda"; others are not checked), or
    None when they can."""
    device = device.lower()
    if device not in _OPTIMIZERS:
        return None
    if optimizer is not None and optimizer not in _OPTIMIZERS[device]:
        return (f"the stock fused kernels cannot run optimizer {optimizer.lower()} on "
                f"{device}")
    if cfg.data_type not in _DTYPES[device]:
        return (f"the stock fused kernels cannot train {cfg.data_type.value} weights on "
                f"{device}")
    return None
