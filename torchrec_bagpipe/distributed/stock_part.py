"""`StockPart`: the tables of a BagPipe-sharded module that keep TorchRec's stock sharding.

A plan may place some tables of one EmbeddingBagCollection / EmbeddingCollection on BagPipe
and the others on TorchRec's own shardings and kernels (data-parallel, table-wise, row-wise,
column-wise; fused, dense, ...). The stock tables are served by TorchRec itself: a
sub-collection holding exactly those tables (the unsharded module's own `nn.EmbeddingBag` /
`nn.Embedding` modules, so their weights and `apply_optimizer_in_backward` settings carry
over) is sharded by TorchRec's `EmbeddingBagCollectionSharder` / `EmbeddingCollectionSharder`
with their part of the plan. The resulting `ShardedEmbeddingBagCollection` /
`ShardedEmbeddingCollection` is a child of the BagPipe-sharded module (`_stock`): its input
dist, lookups, output dist, fused optimizer and state-dict hooks are TorchRec's, unchanged.

This file adds what composing needs:

* `select`: the stock part's features out of the module's input KJT, always in one key order
  (TorchRec's sharded modules fix their feature order at the first batch; the module's input
  may carry extra keys in any order, which the BagPipe part accepts);
* `rename`: the stock sub-collection names a feature shared with a BagPipe table `feature`
  (it does not see the other table), the module names it `feature@table`: the map from the
  stock part's output keys to the module's;
* the stock module's weights: TorchRec's sharded modules copy the unsharded weights in when
  the module is materialised on a device (`EmbeddingBagCollection` off CPU,
  `EmbeddingCollection` off `meta`); the stock part does the same with the same rule.

Thread-safety: the rank's training thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardedModule,
    ShardingEnv,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    get_embedding_names_by_table,
    mark_data_parallel_skip_grad_sync,
    should_skip_data_parallel_grad_sync,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["StockPart", "build_stock_part"]

# Key orders whose selection indices a stock part remembers.
_MAX_CACHED_KEY_ORDERS = 64


class StockPart:
    """TorchRec's sharded module over the stock tables, and the glue around it.

    Args:
        module: the TorchRec sharded module of the stock tables.
        features: the stock tables' features, in the one order the module is always fed.
        rename: the stock module's output keys -> the whole module's output keys.
        weighted: whether the KJT's per-id weights reach the stock tables.
        where: names the module in error messages.
    """

    def __init__(self, module: ShardedModule[Any, Any, Any, Any], features: Sequence[str],
                 rename: Mapping[str, str], weighted: bool, where: str) -> None:
        self.module = module
        self.features = list(features)
        self.rename = dict(rename)
        self._weighted = weighted
        self._where = where
        self._indices: dict[tuple[str, ...], list[int]] = {}

    def select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The stock tables' features of `features`, in `self.features` order (a copy of
        their ids, as TorchRec's own input dist makes; none when already so)."""
        keys = tuple(features.keys())
        indices = self._indices.get(keys)
        if indices is None:
            position = {k: i for i, k in enumerate(keys)}
            missing = [f for f in self.features if f not in position]
            if missing:
                raise ValueError(
                    f"{self._where}: the KJT has no feature {missing[0]!r} (needed by a "
                    f"table on stock TorchRec sharding); its keys are {list(keys)}"
                )
            indices = [position[f] for f in self.features]
            if len(self._indices) < _MAX_CACHED_KEY_ORDERS:
                self._indices[keys] = indices
        kjt = features if indices == list(range(len(keys))) else features.permute(indices)
        if not self._weighted and kjt.weights_or_none() is not None:
            kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                    offsets=kjt.offsets_or_none(), stride=kjt.stride())
        return kjt


def build_stock_part(
    module: EmbeddingBagCollection | EmbeddingCollection,
    configs: Sequence[BaseEmbeddingConfig],
    plan: Mapping[str, ParameterSharding],
    embedding_names: Mapping[str, Sequence[str]],
    *,
    env: ShardingEnv,
    device: torch.device | None,
    fused_params: Mapping[str, Any] | None,
    qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None,
    module_fqn: str | None,
    where: str,
    use_index_dedup: bool = False,
) -> StockPart:
    """Shards the stock tables `configs` of `module` with TorchRec's own sharder.

    `embedding_names`: each table's output keys as the whole module names them.
    """
    meta = torch.device("meta")
    fused = dict(fused_params) if fused_params is not None else None
    # In module order on every rank: TorchRec builds its sharded tensors (collectives) in
    # the order of the plan it is given.
    tables = [cfg.name for cfg in configs]
    sub: EmbeddingBagCollection | EmbeddingCollection
    if isinstance(module, EmbeddingBagCollection):
        sub = EmbeddingBagCollection(tables=list(configs), is_weighted=module.is_weighted(),
                                     device=meta)
        collection, own = sub.embedding_bags, module.embedding_bags
        sharder: Any = EmbeddingBagCollectionSharder(
            fused_params=fused, qcomm_codecs_registry=qcomm_codecs_registry)
        prefix = "embedding_bags"
        # TorchRec's ShardedEmbeddingBagCollection copies the unsharded weights in only off CPU.
        load = module.device.type not in ("meta", "cpu")
        weighted = module.is_weighted()
    else:
        sub = EmbeddingCollection(
            tables=list(configs), device=meta, need_indices=module.need_indices(),
            use_gather_select=module.use_gather_select(),
            use_gather_select_per_sharding=module.use_gather_select_per_sharding(),
        )
        sub.set_use_sorted_select(module.use_sorted_select())
        collection, own = sub.embeddings, module.embeddings
        sharder = EmbeddingCollectionSharder(
            fused_params=fused, qcomm_codecs_registry=qcomm_codecs_registry,
            use_index_dedup=use_index_dedup)
        prefix = "embeddings"
        load = module.device.type != "meta"
        weighted = False
    # The unsharded module's own table modules: their weights and optimizer settings.
    for name in tables:
        collection[name] = own[name]
    if should_skip_data_parallel_grad_sync(module):
        mark_data_parallel_skip_grad_sync(sub)
    sharded = sharder.shard(sub, {name: plan[name] for name in tables}, env, device,
                            module_fqn)
    if load:
        sharded.load_state_dict(
            {f"{prefix}.{name}.weight": own[name].weight for name in tables}, strict=False)

    rename: dict[str, str] = {}
    for cfg, sub_names in zip(configs, get_embedding_names_by_table(list(configs))):
        for sub_name, full in zip(sub_names, embedding_names[cfg.name]):
            rename[sub_name] = full
    features = list(dict.fromkeys(f for cfg in configs for f in cfg.feature_names))
    return StockPart(sharded, features, rename, weighted, where)

