"""The parameter server: storage engine, shards, client, their options and the server program."""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

_LAZY = {
    "EmbeddingStore": "torchrec_bagpipe.ps.store",
    "OptimizerSpec": "torchrec_bagpipe.ps.optimizers",
    "PSClient": "torchrec_bagpipe.ps.client",
    "PSHandle": "torchrec_bagpipe.ps.client",
    "StartStepError": "torchrec_bagpipe.ps.client",
    "PSClientOptions": "torchrec_bagpipe.ps.options",
    "PSShard": "torchrec_bagpipe.ps.shard",
    "PSShardOptions": "torchrec_bagpipe.ps.options",
    "Partitioner": "torchrec_bagpipe.ps.partitioner",
    "SpillWarning": "torchrec_bagpipe.ps.store",
    "ServerProcess": "torchrec_bagpipe.ps.shard",
    "ShardServer": "torchrec_bagpipe.ps.shard",
    "spawn_server": "torchrec_bagpipe.ps.shard",
    "serve_ucx": "torchrec_bagpipe.ps.rdma",
    "UcxShardServer": "torchrec_bagpipe.ps.rdma",
    "client_options": "torchrec_bagpipe.ps.options",
    "shard_options": "torchrec_bagpipe.ps.options",
    "start_local_shards": "torchrec_bagpipe.ps.shard",
    "start_tcp_shard": "torchrec_bagpipe.ps.shard",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
