"""`ShardedBagPipeEmbeddingCollection`: an EmbeddingCollection (unpooled sequence
embeddings) whose BagPipe tables' rows live in the PS, next to tables that keep TorchRec's
stock sharding.

Everything but the output is the EBC's (sharded_module.py, bagpipe_tables.py,
step_lifecycle.py): the same runtime, PS sessions, lookahead window, coherence, fused
optimizer and state dict (keys `embeddings.<table>.weight`). A batch's rows are gathered
once per id instead of pooled (`lookup.sequence_embeddings`): the output is TorchRec's
`Dict[str, JaggedTensor]`, one entry per feature (`feature@table` for a feature several
tables read), values [ids, dim], the feature's lengths, and its ids as weights when the
module was built with `need_indices=True`. The stock part's entries come from TorchRec's own sharded
EmbeddingCollection; the dict lists every key in the unsharded module's order.

Thread-safety: one training thread per rank (the autograd thread runs the backward hook
while that thread waits in backward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.distributed.types import (
    LazyAwaitable,
    LazyNoWait,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.lookup import sequence_embeddings
from torchrec_bagpipe.distributed.sharded_module import BagPipeShardedModule
from torchrec_bagpipe.distributed.types import BagPipeContext

__all__ = ["ShardedBagPipeEmbeddingCollection"]


class ShardedBagPipeEmbeddingCollection(BagPipeShardedModule):
    """Sharded EC: BagPipe tables in the PS, the others on TorchRec's stock shardings (see
    module docstring)."""

    _COLLECTION = "embeddings"
    _KIND = "EmbeddingCollection"

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        config: BagPipeConfig | None = None,
        fused_params: Mapping[str, Any] | None = None,
        module_fqn: str | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        super().__init__()
        self._need_indices = bool(module.need_indices())
        self._init_parts(module, module.embedding_configs(), table_name_to_parameter_sharding,
                         env, device, config, fused_params, qcomm_codecs_registry, module_fqn,
                         weighted=False, use_index_dedup=use_index_dedup)

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingCollection

    # ---- outputs ------------------------------------------------------------------------------
    def _bagpipe_output(self, ctx: BagPipeContext, kjts: Sequence[KeyedJaggedTensor]
                        ) -> dict[str, JaggedTensor]:
        out: dict[str, JaggedTensor] = {}
        batch = self._bagpipe.batch_rows(ctx.keys, ctx.training)
        for g, (spec, rows) in enumerate(zip(self._bagpipe.layout.fused, batch)):
            for slot, jt in zip(spec.slots, sequence_embeddings(kjts[g], rows,
                                                                 self._need_indices)):
                out[slot.key] = jt
        return out

    def _combine(self, stock: LazyAwaitable[Any] | None, bagpipe: Any
                 ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        if stock is None:
            return LazyNoWait(self._ordered(bagpipe, None))
        return _MixedJaggedDict(stock, bagpipe, self._ordered)

    def _ordered(self, bagpipe: dict[str, JaggedTensor],
                 stock: Mapping[str, JaggedTensor] | None) -> dict[str, JaggedTensor]:
        """Both parts' entries, keyed and ordered as the unsharded module's."""
        merged = dict(bagpipe)
        if stock is not None:
            rename = self._stock_part.rename  # type: ignore[union-attr]
            merged.update((rename[k], v) for k, v in stock.items())
        return {k: merged[k] for k in self._embedding_names}


class _MixedJaggedDict(LazyAwaitable[dict[str, JaggedTensor]]):
    """The module's output once the stock part's output dist is done."""

    def __init__(self, stock: LazyAwaitable[dict[str, JaggedTensor]],
                 bagpipe: dict[str, JaggedTensor], ordered: Any) -> None:
        super().__init__()
        self._stock = stock
        self._bagpipe_out = bagpipe
        self._ordered = ordered

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        return self._ordered(self._bagpipe_out, self._stock.wait())
