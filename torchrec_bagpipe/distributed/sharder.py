"""The BagPipe sharders: the one thing users swap into DMP.

DMP routes modules to sharders by exact module type, so each sharder serves every module of
its type in the model:

* `BagPipeEmbeddingBagCollectionSharder` — `EmbeddingBagCollection`;
* `BagPipeEmbeddingCollectionSharder` — `EmbeddingCollection` (unpooled sequence embeddings).

A module whose plan places at least one table on the BagPipe kernel (`customized_kernel`,
data-parallel placement) becomes `ShardedBagPipeEmbeddingBagCollection` /
`ShardedBagPipeEmbeddingCollection`; its other tables keep their stock TorchRec sharding
inside it (stock_part.py). A module whose plan names only stock kernels is handed to
TorchRec's own sharder unchanged. `bagpipe_sharders(config)` returns both sharders.

The sharders hold only their configuration: they are picklable and can be built before
torch.distributed is initialised.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
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
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.distributed.embedding import ShardedBagPipeEmbeddingCollection
from torchrec_bagpipe.distributed.embeddingbag import ShardedBagPipeEmbeddingBagCollection
from torchrec_bagpipe.distributed.estimators import METADATA_BYTES_PER_ROW, register_tables
from torchrec_bagpipe.distributed.table_optimizer import state_floats
from torchrec_bagpipe.distributed.types import BAGPIPE_KERNEL

__all__ = [
    "METADATA_BYTES_PER_ROW",
    "BagPipeEmbeddingBagCollectionSharder",
    "BagPipeEmbeddingCollectionSharder",
    "bagpipe_sharders",
]

M = TypeVar("M", bound=nn.Module)


class _BagPipeSharder(BaseEmbeddingSharder[M], Generic[M]):
    """What both BagPipe sharders share: the config, the BagPipe kernel next to the stock
    ones, storage estimates, and handing all-stock modules to TorchRec's sharder."""

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

    @abc.abstractmethod
    def _stock(self) -> BaseEmbeddingSharder[M]:
        """TorchRec's own sharder for this module type, with the same fused params."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        # Those of TorchRec's own sharder (the BagPipe kernel is data-parallel), so a plan
        # for the stock tables is the stock planner's.
        return self._stock().sharding_types(compute_device_type)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        stock = self._stock().compute_kernels(sharding_type, compute_device_type)
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return [BAGPIPE_KERNEL, *stock]
        return stock

    def storage_usage(
        self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str
    ) -> dict[str, int]:
        if compute_kernel != BAGPIPE_KERNEL:
            return self._stock().storage_usage(tensor, compute_device_type, compute_kernel)
        # Rows live in the PS; the device holds a bounded cache of them (weights and optimizer
        # state) plus metadata.
        rows = min(int(tensor.shape[0]), self._config.cache_rows(int(tensor.shape[0])))
        dim = int(tensor.shape[1])
        row_bytes = (dim + state_floats(tensor, self.fused_params, dim, "BagPipe table")) * 4
        cache = rows * (row_bytes + METADATA_BYTES_PER_ROW)
        kind = ParameterStorage.HBM if compute_device_type == "cuda" else ParameterStorage.DDR
        return {kind.value: cache}

    @staticmethod
    def _bagpipe_tables(params: Mapping[str, ParameterSharding]) -> set[str]:
        return {name for name, p in params.items() if p.compute_kernel == BAGPIPE_KERNEL}

    def _module_kwargs(self) -> dict[str, Any]:
        """Extra constructor arguments of this sharder's sharded module."""
        return {}

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        # TorchRec's planner calls this before it builds the module's sharding options: the
        # tables' facts reach the placement rule in its perf estimates (estimators.py).
        register_tables(module, self.fused_params, self._config)
        return self._stock().shardable_parameters(module)

    def shard(
        self,
        module: M,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule[Any, Any, Any, Any]:
        """A module without BagPipe tables goes to TorchRec's own sharder unchanged."""
        if not self._bagpipe_tables(params):
            return self._stock().shard(module, params, env, device, module_fqn)
        return self.sharded_module_type(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            device=device,
            config=self._config,
            fused_params=self.fused_params,
            module_fqn=module_fqn,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            **self._module_kwargs(),
        )


class BagPipeEmbeddingBagCollectionSharder(_BagPipeSharder[EmbeddingBagCollection]):
    """Shards EmbeddingBagCollections: BagPipe tables onto the PS, the others with TorchRec.

    Args:
        config: every BagPipe knob; `None` means `BagPipeConfig()` (zero-config: PS shards
            inside the trainer processes, online planning, `ps` aggregation).
        fused_params: TorchRec-style fused parameters (they reach the stock tables' kernels
            too): the BagPipe tables' optimizer (``"optimizer": EmbOptimType...``,
            ``"learning_rate"``, ``"eps"``, ``"beta1"``, ``"beta2"``, ``"weight_decay"``)
            unless `apply_optimizer_in_backward(...)` set one on a table's parameter
            (table_optimizer.py lists what is supported).
        qcomm_codecs_registry: passed to TorchRec's sharder for the stock tables.
    """

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedBagPipeEmbeddingBagCollection]:
        return ShardedBagPipeEmbeddingBagCollection

    def _stock(self) -> EmbeddingBagCollectionSharder:
        return EmbeddingBagCollectionSharder(
            fused_params=self.fused_params, qcomm_codecs_registry=self.qcomm_codecs_registry
        )


class BagPipeEmbeddingCollectionSharder(_BagPipeSharder[EmbeddingCollection]):
    """Shards EmbeddingCollections (sequence embeddings): BagPipe tables onto the PS, the
    others with TorchRec. Arguments as `BagPipeEmbeddingBagCollectionSharder`, plus
    `use_index_dedup` for TorchRec's sharder of the stock tables."""

    def __init__(
        self,
        config: BagPipeConfig | None = None,
        fused_params: Mapping[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        use_index_dedup: bool = False,
    ) -> None:
        super().__init__(config, fused_params, qcomm_codecs_registry)
        self._use_index_dedup = use_index_dedup

    @property
    def module_type(self) -> type[EmbeddingCollection]:
        return EmbeddingCollection

    @property
    def sharded_module_type(self) -> type[ShardedBagPipeEmbeddingCollection]:
        return ShardedBagPipeEmbeddingCollection

    def _stock(self) -> EmbeddingCollectionSharder:
        return EmbeddingCollectionSharder(
            fused_params=self.fused_params, qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
        )

    def _module_kwargs(self) -> dict[str, Any]:
        return {"use_index_dedup": self._use_index_dedup}


def bagpipe_sharders(
    config: BagPipeConfig | None = None,
    fused_params: Mapping[str, Any] | None = None,
    qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
) -> list[_BagPipeSharder[Any]]:
    """Both BagPipe sharders with one config (for `DistributedModelParallel(sharders=...)`
    and the planner)."""
    return [
        BagPipeEmbeddingBagCollectionSharder(config, fused_params, qcomm_codecs_registry),
        BagPipeEmbeddingCollectionSharder(config, fused_params, qcomm_codecs_registry),
    ]

