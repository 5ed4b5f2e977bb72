"""torchrec_bagpipe: TorchRec embeddings on a native parameter server with BagPipe caching.

Public names are imported lazily so `import torchrec_bagpipe` stays cheap and does not pull
in torchrec until a TorchRec-facing name is used.
"""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

__version__ = "0.1.0"

_LAZY = {
    "BagPipeConfig": "torchrec_bagpipe.config",
    "BagPipeController": "torchrec_bagpipe.runtime.controller",
    "EmbeddingStore": "torchrec_bagpipe.ps.store",
    # TorchRec integration
    "BagPipeEmbeddingBagCollectionSharder": "torchrec_bagpipe.distributed.sharder",
    "BagPipeEmbeddingCollectionSharder": "torchrec_bagpipe.distributed.sharder",
    "bagpipe_sharders": "torchrec_bagpipe.distributed.sharder",
    "BagPipeShardingPlanner": "torchrec_bagpipe.distributed.sharding_planner",
    "BagPipeTrainPipeline": "torchrec_bagpipe.distributed.train_pipeline",
    "ShardedBagPipeEmbeddingBagCollection": "torchrec_bagpipe.distributed.embeddingbag",
    "ShardedBagPipeEmbeddingCollection": "torchrec_bagpipe.distributed.embedding",
    "bagpipe_plan": "torchrec_bagpipe.distributed.sharding_planner",
    "bagpipe": "torchrec_bagpipe.distributed.plan_helpers",
    "PowerLawCriteoDataset": "torchrec_bagpipe.datasets.synthetic",
    "SessionError": "torchrec_bagpipe._native",
    "ShuttingDownError": "torchrec_bagpipe._native",
    "TransportError": "torchrec_bagpipe._native",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
