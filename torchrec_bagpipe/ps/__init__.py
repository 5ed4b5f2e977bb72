"""The parameter server: storage engine, shards, client, their specs and the server program."""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

_LAZY = {
    "EmbeddingStore": "torchrec_bagpipe.ps.store",
    "SpillWarning": "torchrec_bagpipe.ps.store",
    "PSClient": "torchrec_bagpipe.ps.client",
    "PSHandle": "torchrec_bagpipe.ps.client",
    "StartStepError": "torchrec_bagpipe.ps.client",
    "PSShard": "torchrec_bagpipe.ps.shard",
    "ServerProcess": "torchrec_bagpipe.ps.shard",
    "ShardServer": "torchrec_bagpipe.ps.shard",
    "spawn_server": "torchrec_bagpipe.ps.shard",
    "start_local_shards": "torchrec_bagpipe.ps.shard",
    "start_tcp_shard": "torchrec_bagpipe.ps.shard",
    "serve_ucx": "torchrec_bagpipe.ps.rdma",
    "UcxShardServer": "torchrec_bagpipe.ps.rdma",
    "Partitioner": "torchrec_bagpipe.ps.partitioner",
    # the specs, and the one place a BagPipeConfig becomes them
    "OptimizerSpec": "torchrec_bagpipe.ps.optimizer_spec",
    "TableSchema": "torchrec_bagpipe.ps.table_specs",
    "StoreLayout": "torchrec_bagpipe.ps.table_specs",
    "StoreSpec": "torchrec_bagpipe.ps.table_specs",
    "LoadSpec": "torchrec_bagpipe.ps.table_specs",
    "ShardSpec": "torchrec_bagpipe.ps.shard_specs",
    "TcpServerSpec": "torchrec_bagpipe.ps.shard_specs",
    "UcxServerSpec": "torchrec_bagpipe.ps.shard_specs",
    "ClientSpec": "torchrec_bagpipe.ps.client_spec",
    "client_spec": "torchrec_bagpipe.ps.config_specs",
    "shard_spec": "torchrec_bagpipe.ps.config_specs",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
