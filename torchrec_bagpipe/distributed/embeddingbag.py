"""`ShardedBagPipeEmbeddingBagCollection`: an EmbeddingBagCollection whose BagPipe tables'
rows live in the PS, next to tables that keep TorchRec's stock sharding.

The shared machinery (both parts, input dist, fused optimizer, state dict) is in
sharded_module.py; the BagPipe part's step lifecycle in step_lifecycle.py. This file turns
the rows a batch reads into pooled bags and the two parts' outputs into one `KeyedTensor`.

Data flow of one training batch (ARCHITECTURE §5):

* `input_dist` (called one or more batches ahead by TrainPipelineSparseDist) validates the
  KJT, turns it into fused keys per fused table and submits them to the runtime, unless
  `BagPipeTrainPipeline` already submitted that batch ahead; the stock part's features go
  to TorchRec's input dist.
* `compute_and_output_dist` runs the stock part's lookups and output dist, takes the oldest
  step from each fused table (the batch's unique rows as a |U| x dim leaf tensor and the
  inverse map) and pools it, so autograd yields exactly the |U| x dim row gradient. A hook
  on the leaf hands that gradient to the fused table's runtime (`finish_step`), which
  commits it at the learning rate of the fused optimizer's param group (fused_optimizer.py).
* The output is one `KeyedTensor` in the unsharded EBC's key order: the BagPipe part's
  columns and the stock part's, gathered into place.

Eval forwards (module not training, or training under `torch.no_grad()`) read the BagPipe
rows straight from the PS after the commits of finished steps; they never enter the
runtime's step sequence (step_lifecycle.py).

Thread-safety: one training thread per rank (the autograd thread runs the backward hook
while that thread waits in backward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.types import (
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.lookup import Pooler
from torchrec_bagpipe.distributed.sharded_module import BagPipeShardedModule
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL, BagPipeContext

__all__ = ["BAGPIPE_KERNEL", "ShardedBagPipeEmbeddingBagCollection"]

# Stock key orders whose output column runs a module remembers.
_MAX_CACHED_KEY_ORDERS = 16


class ShardedBagPipeEmbeddingBagCollection(BagPipeShardedModule):
    """Sharded EBC: BagPipe tables in the PS, the others on TorchRec's stock shardings (see
    module docstring)."""

    _COLLECTION = "embedding_bags"
    _KIND = "EmbeddingBagCollection"

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        config: BagPipeConfig | None = None,
        fused_params: Mapping[str, Any] | None = None,
        module_fqn: str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__()
        self._is_weighted = bool(module.is_weighted())
        configs = module.embedding_bag_configs()
        self._init_parts(module, configs, table_name_to_parameter_sharding, env, device, config,
                         fused_params, qcomm_codecs_registry, module_fqn,
                         weighted=self._is_weighted)
        layout = self._bagpipe.layout
        self._poolers = [
            Pooler([layout.table(s.table).pooling == "mean" for s in spec.slots],
                   self._is_weighted)
            for spec in layout.fused
        ]
        self._bagpipe_keys = [(s.key, s.dim) for s in layout.grouped_slots]
        self._runs: dict[tuple[str, ...], list[_Run] | None] = {}

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection

    # ---- outputs ------------------------------------------------------------------------------
    def _bagpipe_output(self, ctx: BagPipeContext, kjts: Sequence[KeyedJaggedTensor]
                        ) -> torch.Tensor:
        """[batch, columns] of the BagPipe part, fused table by fused table."""
        b = ctx.batch_size
        parts: list[torch.Tensor] = []
        batch = self._bagpipe.batch_rows(ctx.keys, ctx.training)
        for g, (spec, rows) in enumerate(zip(self._bagpipe.layout.fused, batch)):
            pooled = self._poolers[g](kjts[g], rows)
            # Slot-major (slots x batch x dim) -> batch x (slots * dim): one copy, whose
            # backward is one copy too (per-slot views would each back-propagate a zero-filled
            # gradient of the whole pooled tensor).
            parts.append(pooled.view(len(spec.slots), b, spec.dim).transpose(0, 1)
                         .reshape(b, len(spec.slots) * spec.dim))
        if not parts:
            return torch.empty(b, 0, device=self._device)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _combine(self, stock: LazyAwaitable[Any] | None, bagpipe: Any
                 ) -> LazyAwaitable[KeyedTensor]:
        if stock is None:
            return LazyNoWait(self._keyed(bagpipe, None))
        return _MixedKeyedTensor(stock, bagpipe, self._keyed)

    def _keyed(self, bagpipe: torch.Tensor, stock: KeyedTensor | None) -> KeyedTensor:
        """Both parts' columns as one KeyedTensor in the unsharded module's key order."""
        sources = [self._bagpipe_keys]
        tensors = [bagpipe]
        if stock is not None:
            rename = self._stock_part.rename  # type: ignore[union-attr]
            sources.append([(rename[k], d) for k, d in zip(stock.keys(), stock.length_per_key())])
            tensors.append(stock.values())
        order = tuple(k for source in sources for k, _ in source)
        if order in self._runs:
            runs = self._runs[order]
        else:
            runs = _column_runs(sources, self._embedding_names)
            if len(self._runs) < _MAX_CACHED_KEY_ORDERS:
                self._runs[order] = runs
        if runs is None:
            values = tensors[0]
        else:
            values = _MergeColumns.apply(runs, [int(t.shape[1]) for t in tensors],
                                         sum(self._embedding_dims), *tensors)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._embedding_dims,
                           values=values, key_dim=1)


class _MixedKeyedTensor(LazyGetItemMixin[str, torch.Tensor], LazyAwaitable[KeyedTensor]):
    """The module's output once the stock part's output dist is done."""

    def __init__(self, stock: LazyAwaitable[KeyedTensor], bagpipe: torch.Tensor,
                 keyed: Any) -> None:
        super().__init__()
        self._stock = stock
        self._bagpipe_values = bagpipe
        self._keyed = keyed

    def _wait_impl(self) -> KeyedTensor:
        return self._keyed(self._bagpipe_values, self._stock.wait())


@dataclass(frozen=True)
class _Run:
    """Columns [src, src + width) of source `source` land at [dst, dst + width)."""

    source: int
    src: int
    dst: int
    width: int


def _column_runs(sources: Sequence[Sequence[tuple[str, int]]], target: Sequence[str]
                 ) -> list[_Run] | None:
    """The contiguous column runs that put the keys of `sources` (each a list of (key,
    width) in its column order) into `target`'s order, or None when the first source alone
    already is `target`."""
    where: dict[str, tuple[int, int, int]] = {}
    for i, source in enumerate(sources):
        col = 0
        for key, width in source:
            where[key] = (i, col, width)
            col += width
    if len(sources) == 1 and [k for k, _ in sources[0]] == list(target):
        return None
    runs: list[_Run] = []
    dst = 0
    for key in target:
        i, src, width = where[key]
        last = runs[-1] if runs else None
        if last is not None and last.source == i and last.src + last.width == src:
            runs[-1] = _Run(i, last.src, last.dst, last.width + width)
        else:
            runs.append(_Run(i, src, dst, width))
        dst += width
    return runs


class _MergeColumns(torch.autograd.Function):
    """Sources' column runs copied into one [batch, total] tensor; the backward copies the
    gradient's runs back (one pass each way: no zero-filled intermediates)."""

    @staticmethod
    def forward(ctx: Any, runs: list[_Run], widths: list[int], total: int,
                *sources: torch.Tensor) -> torch.Tensor:
        out = sources[0].new_empty(sources[0].shape[0], total)
        for r in runs:
            out[:, r.dst:r.dst + r.width].copy_(sources[r.source][:, r.src:r.src + r.width])
        ctx.runs = runs
        ctx.widths = widths
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = [grad.new_empty(grad.shape[0], w) for w in ctx.widths]
        for r in ctx.runs:
            grads[r.source][:, r.src:r.src + r.width].copy_(grad[:, r.dst:r.dst + r.width])
        return (None, None, None, *grads)
