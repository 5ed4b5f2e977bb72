"""TorchRec integration: sharders, sharded EBC and EC, planner helpers and the train pipeline."""

from __future__ import annotations

from torchrec_bagpipe._lazy import lazy_names

_LAZY = {
    "BAGPIPE_KERNEL": "torchrec_bagpipe.distributed.types",
    "ShardedBagPipeEmbeddingBagCollection": "torchrec_bagpipe.distributed.embeddingbag",
    "ShardedBagPipeEmbeddingCollection": "torchrec_bagpipe.distributed.embedding",
    "BagPipeShardedModule": "torchrec_bagpipe.distributed.sharded_module",
    "BagPipeEmbeddingBagCollectionSharder": "torchrec_bagpipe.distributed.sharder",
    "BagPipeEmbeddingCollectionSharder": "torchrec_bagpipe.distributed.sharder",
    "bagpipe_sharders": "torchrec_bagpipe.distributed.sharder",
    "BagPipeModuleShardingPlan": "torchrec_bagpipe.distributed.placement",
    "TablePlacement": "torchrec_bagpipe.distributed.placement",
    "BagPipeShardingPlanner": "torchrec_bagpipe.distributed.sharding_planner",
    "BagPipePerfEstimator": "torchrec_bagpipe.distributed.estimators",
    "BagPipeStorageEstimator": "torchrec_bagpipe.distributed.estimators",
    "BagPipeAwarePerfConfig": "torchrec_bagpipe.distributed.estimators",
    "bagpipe": "torchrec_bagpipe.distributed.plan_helpers",
    "bagpipe_plan": "torchrec_bagpipe.distributed.sharding_planner",
    "bagpipe_parameter_sharding": "torchrec_bagpipe.distributed.sharding_planner",
    "BagPipeTrainPipeline": "torchrec_bagpipe.distributed.train_pipeline",
    "BagPipeFusedOptimizer": "torchrec_bagpipe.distributed.fused_optimizer",
    "UnsupportedOptimizerError": "torchrec_bagpipe.distributed.table_optimizer",
    "table_optimizer": "torchrec_bagpipe.distributed.table_optimizer",
    "TorchDistCollectives": "torchrec_bagpipe.distributed.process_group_collectives",
    "close_job": "torchrec_bagpipe.distributed.job",
    "PSCheckpointError": "torchrec_bagpipe.distributed.fused_table_runtime",
    "NonFiniteGradientError": "torchrec_bagpipe.distributed.grad_check",
    "SpecMismatchError": "torchrec_bagpipe.distributed.agreement",
    "bagpipe_modules": "torchrec_bagpipe.distributed.utils",
    "bagpipe_metrics": "torchrec_bagpipe.distributed.utils",
    "prescan_model": "torchrec_bagpipe.distributed.utils",
    "close_model": "torchrec_bagpipe.distributed.utils",
    "flush_model": "torchrec_bagpipe.distributed.utils",
    "save_job_checkpoint": "torchrec_bagpipe.distributed.job_checkpoint",
    "load_job_checkpoint": "torchrec_bagpipe.distributed.job_checkpoint",
    "restore_rng_state": "torchrec_bagpipe.distributed.job_checkpoint",
    "checkpoint_due": "torchrec_bagpipe.distributed.job_checkpoint",
    "resumed_step": "torchrec_bagpipe.distributed.job_checkpoint",
    "read_manifest": "torchrec_bagpipe.distributed.checkpoint_manifest",
    "StepTTLEvictionPolicy": "torchrec_bagpipe.distributed.virtual_tables",
    "AdmissionPolicy": "torchrec_bagpipe.distributed.virtual_tables",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
