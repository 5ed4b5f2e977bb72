"""Plain descriptions of what a BagPipe-sharded embedding module holds.

A sharded module (EmbeddingBagCollection or EmbeddingCollection) has two parts: the tables
the plan places on BagPipe (rows in the PS) and, optionally, the tables that keep TorchRec's
stock sharding (stock_part.py).

A *slot* is one (table, feature) pair of the module, in the module's own order (tables in
order, each table's features in order); slots define the output keys (`feature`, or
`feature@table` when several tables read the feature, as TorchRec names them). Tables with
the same embedding dim, optimizer and learning rate are *fused* into one key space
(`fused key = table offset + id`), one PS session and one runtime controller each
(layout.py builds them; fused_table_runtime.py runs them).

Invariants:
1. Within a fused table, table offsets are increasing and disjoint:
   `offset[t+1] = offset[t] + num_embeddings[t]`; `num_keys` is their sum.
2. `FusedTableSpec.slots` lists the fused table's slots in EBC order; a slot belongs to
   exactly one fused table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import Multistreamable

from torchrec_bagpipe.ps.optimizer_spec import OptimizerSpec
from torchrec_bagpipe.runtime.eviction import EvictionSpec

__all__ = [
    "BAGPIPE_KERNEL",
    "BagPipeContext",
    "BatchRows",
    "FusedTableSpec",
    "SlotSpec",
    "TableSpec",
]

_SGD = OptimizerSpec()

# The compute kernel a sharding plan names for a BagPipe table.
BAGPIPE_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_embeddings: int
    dim: int
    feature_names: tuple[str, ...]
    pooling: str  # "sum" | "mean" (how lookup.py pools a bag of this table's rows)
    lr: float  # the initial learning rate (an LR scheduler may change it every step)
    init_max: float  # TorchRec's default init bound: uniform in [-init_max, init_max]
    optimizer: OptimizerSpec = _SGD  # what the PS applies to its rows
    # A virtual table's eviction rule (use_virtual_table=True; trigger_rows per trainer
    # rank, as TorchRec counts it); None: an ordinary table (distributed/virtual_tables.py).
    eviction: EvictionSpec | None = None


@dataclass(frozen=True)
class SlotSpec:
    index: int  # position in the module's output order
    table: str
    feature: str
    key: str  # output key
    dim: int


@dataclass
class FusedTableSpec:
    """One fused key space: the tables of one (dim, optimizer, lr), one PS session, one
    controller, one param group of the fused optimizer."""

    name: str  # PS session table name, unique per job
    dim: int
    lr: float
    tables: list[TableSpec]
    offsets: dict[str, int]  # table name -> its first fused key
    num_keys: int
    slots: list[SlotSpec] = field(default_factory=list)
    optimizer: OptimizerSpec = _SGD
    eviction: EvictionSpec | None = None  # virtual tables: their rule (one per fused table)


@dataclass(frozen=True)
class BatchRows:
    """The rows one batch reads from one fused table: its unique rows and, per id of the
    batch (in slot order), which of them it reads (``rows[inverse[i]]``)."""

    rows: torch.Tensor     # [U, dim] fp32, on the module's device (training: a leaf whose
    #                        gradient is the step's |U| x dim row gradient)
    inverse: torch.Tensor  # [n] int64, on the rows' device


@dataclass
class BagPipeContext(Multistreamable):
    """Carries one batch from `input_dist` to `compute` (both parts of the module).

    training: whether the batch was submitted to the runtime (a training step: module
    training with autograd enabled) or is looked up directly from the PS (eval forward).
    batch_size: the batch's stride.
    keys: per fused table of the BagPipe part, the batch's fused keys in slot order.
    stock: the stock part's own TorchRec context (None without a stock part).
    stock_inputs: how many leading entries of the module's `KJTList` belong to the stock part
    (its input dists come first, so TorchRec's pipeline fills `sharding_contexts` by position).
    """

    training: bool = True
    batch_size: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    stock: Any = None
    stock_inputs: int = 0

    @property
    def sharding_contexts(self) -> list[Any]:
        """The stock part's sharding contexts (TorchRec's input dist and its fused splits
        read and fill them by position: the stock part's inputs come first)."""
        return getattr(self.stock, "sharding_contexts", []) if self.stock is not None else []

    @property
    def early_releasable_inputs(self) -> list[Any]:
        return getattr(self.stock, "early_releasable_inputs", []) if self.stock is not None else []

    def record_stream(self, stream: torch.Stream) -> None:
        for k in self.keys:
            if k.device.type == "cuda":
                k.record_stream(stream)  # type: ignore[arg-type]
        if self.stock is not None:
            self.stock.record_stream(stream)
