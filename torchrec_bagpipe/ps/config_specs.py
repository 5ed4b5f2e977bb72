"""The one place a `BagPipeConfig` becomes PS specs.

`client_spec` (a trainer rank's `ClientSpec` of one table: the TorchRec deployment) and
`shard_spec` (a PS shard's `ShardSpec`: a trainer-hosted shard, or the
``torchrec-bagpipe-ps`` program) map config fields onto spec fields; nothing else reads PS
settings off a config. The facts no config field holds (a table's name, dim, lr, init,
optimizer; a server's store shards or checkpoints) are the caller's keyword arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchrec_bagpipe.config import BagPipeConfig
from torchrec_bagpipe.ps.client_spec import ClientSpec
from torchrec_bagpipe.ps.shard_specs import ShardSpec
from torchrec_bagpipe.ps.table_specs import StoreLayout

__all__ = ["client_spec", "shard_spec"]


def _config_client_fields(config: BagPipeConfig) -> dict[str, Any]:
    """ClientSpec field -> its value under `config`."""
    return {
        "gradient_division": config.resolved_gradient_division(),
        "partitioner": config.partitioner,
        "job_token": config.job_token or "",
        "max_packet_rows": config.max_packet_rows,
        "inflight_packets": config.inflight_packets,
        "timeout": config.ps_timeout,
        "connect_timeout": config.connect_timeout,
        "seed": config.init_seed,
    }


def client_spec(config: BagPipeConfig, **fields: Any) -> ClientSpec:
    """One rank's client of a table under `config`: the config gives its gradient division,
    partitioner, packet rows, window, timeouts, init seed and job token; `fields` are the
    other `ClientSpec` fields (table, dim, lr, rank, world_size, init, init_bound,
    init_value, key_bound, optimizer, session_id), and `job_token` when the job agreed on
    one (it replaces the config's)."""
    from_config = _config_client_fields(config)
    clash = sorted(set(fields) & set(from_config) - {"job_token"})
    if clash:
        raise TypeError(f"client_spec: {clash} come from the BagPipeConfig")
    return ClientSpec(**{**from_config, **fields})


def shard_spec(config: BagPipeConfig, shard_id: int, num_shards: int, *,
               store: StoreLayout | None = None, **fields: Any) -> ShardSpec:
    """Shard `shard_id` of `num_shards` under `config`: the config gives its store's
    threads, memory budget and spill directory and how its checkpoints chain
    (ps_checkpoint_incremental, ps_checkpoint_full_every, ps_checkpoint_chain_fraction,
    ps_checkpoint_background);
    `store` the rest of the layout (hash shards, page rows, watermarks); `fields` the other
    `ShardSpec` fields (dim, checkpoint_dir, checkpoint_every, max_frame_bytes)."""
    layout = dataclasses.replace(store or StoreLayout(), num_threads=config.store_threads,
                                 memory_budget=config.memory_budget,
                                 spill_dir=config.spill_dir)
    from_config = _config_shard_fields(config)
    clash = sorted(set(fields) & set(from_config))
    if clash:
        raise TypeError(f"shard_spec: {clash} come from the BagPipeConfig")
    return ShardSpec(shard_id, num_shards, store=layout, **from_config, **fields)


def _config_shard_fields(config: BagPipeConfig) -> dict[str, Any]:
    """ShardSpec field (besides the store's) -> its value under `config`."""
    return {
        "checkpoint_incremental": config.ps_checkpoint_incremental,
        "checkpoint_full_every": config.ps_checkpoint_full_every,
        "checkpoint_chain_fraction": config.ps_checkpoint_chain_fraction,
        "checkpoint_background": config.ps_checkpoint_background,
    }
