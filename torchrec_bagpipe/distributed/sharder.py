"""`BagPipeEmbeddingBagCollectionSharder`: the one thing users swap into DMP.

DMP routes modules to sharders by exact module type, so this sharder serves every
`EmbeddingBagCollection` of the model: modules whose plan names the BagPipe kernel
(`customized_kernel`, data-parallel placement) become `ShardedBagPipeEmbeddingBagCollection`;
modules whose plan names only stock kernels are handed to TorchRec's own
`EmbeddingBagCollectionSharder` unchanged, so tables that are not ours keep stock sharding
in the same model. One module mixing both kinds of tables is refused with a clear error
(plan those tables into separate EmbeddingBagCollections).

The sharder holds only its configuration: it is picklable and can be built before
torch.distributed is initialised.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_types import BaseEmbeddingSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import (
    ParameterSharding,
    ParameterStorage,
    QuantizedCommCodecs,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.embeddingbag import ShardedBagPipeEmbeddingBagCollection
from torchrec_bagpipe.distributed.table_optimizer import state_floats
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL

__all__ = ["BagPipeEmbeddingBagCollectionSharder"]


class BagPipeEmbeddingBagCollectionSharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    """Shards EmbeddingBagCollections onto the BagPipe PS.

    Args:
        config: every BagPipe knob; `None` means `BagPipeConfig()` (zero-config: PS shards
            inside the trainer processes, online planning, `ps` aggregation).
        fused_params: TorchRec-style fused parameters: the tables' optimizer
            (``"optimizer": EmbOptimType...``, ``"learning_rate"``, ``"eps"``, ``"beta1"``,
            ``"beta2"``, ``"weight_decay"``) unless `apply_optimizer_in_backward(...)` set one
            on a table's parameter (table_optimizer.py lists what is supported).
        qcomm_codecs_registry: passed to the stock sharder for stock-sharded modules.
    """

    def __init__(
        self,
        config: BagPipeConfig | None = None,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(
            fused_params=dict(fused_params) if fused_params is not None else None,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
        if config is not None and not isinstance(config, BagPipeConfig):
            raise TypeError(
                f"config must be a BagPipeConfig or None, got {type(config).__name__}"
            )
        self._config = copy.deepcopy(config) if config is not None else BagPipeConfig()

    @property
    def config(self) -> BagPipeConfig:
        return self._config

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedBagPipeEmbeddingBagCollection]:
        return ShardedBagPipeEmbeddingBagCollection

    def shardable_parameters(self, module: EmbeddingBagCollection) -> dict[str, nn.Parameter]:
        return {
            name.split(".")[0]: param for name, param in module.embedding_bags.named_parameters()
        }

    def sharding_types(self, compute_device_type: str) -> list[str]:
        # Data-parallel placement for BagPipe tables, and every stock type so that a plan may
        # keep some EmbeddingBagCollections on TorchRec's own kernels.
        return super().sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        stock = super().compute_kernels(sharding_type, compute_device_type)
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return [BAGPIPE_KERNEL, *stock]
        return stock

    def storage_usage(
        self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str
    ) -> dict[str, int]:
        if compute_kernel != BAGPIPE_KERNEL:
            return super().storage_usage(tensor, compute_device_type, compute_kernel)
        # Rows live in the PS; the device holds a bounded cache of them (weights and optimizer
        # state) plus metadata.
        rows = min(int(tensor.shape[0]), self._config.cache_rows(int(tensor.shape[0])))
        dim = int(tensor.shape[1])
        row_bytes = (dim + state_floats(tensor, self.fused_params, dim, "BagPipe table")) * 4
        cache = rows * (row_bytes + _METADATA_BYTES_PER_ROW)
        kind = ParameterStorage.HBM if compute_device_type == "cuda" else ParameterStorage.DDR
        return {kind.value: cache}

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule[Any, Any, Any, Any]:
        ours = {name for name, p in params.items() if p.compute_kernel == BAGPIPE_KERNEL}
        if not ours:
            stock = EmbeddingBagCollectionSharder(
                fused_params=self.fused_params, qcomm_codecs_registry=self.qcomm_codecs_registry
            )
            return stock.shard(module, params, env, device, module_fqn)
        if ours != set(params):
            others = sorted(set(params) - ours)
            raise ValueError(
                f"EmbeddingBagCollection {module_fqn or '<root>'}: tables {sorted(ours)} are "
                f"planned on the BagPipe kernel and {others} on stock kernels; put the "
                "tables that keep stock sharding in a separate EmbeddingBagCollection"
            )
        return ShardedBagPipeEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            device=device,
            config=self._config,
            fused_params=self.fused_params,
            module_fqn=module_fqn,
        )


# Key -> slot map entry, LRU/oracle bookkeeping and the previous-update step of a cached row.
_METADATA_BYTES_PER_ROW = 32
