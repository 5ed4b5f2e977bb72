"""`BagPipeCacheMetadata`: the native cache metadata (csrc/cache/cache_metadata.h).

Capacity in units of 64 rows; batched query of a batch's unique keys -> hit slots and miss
positions; admission returning, for each destination slot, its source row (unique
destinations, bounded admission for batches larger than the cache);
eviction policies ``lru`` and ``oracle``; invalidation; per-row versions (the step whose
commit the cached values reflect). Arrays are borrowed per call (1-D contiguous int64 numpy;
pass torch CPU tensors as ``t.numpy()``) and the GIL is released around the native work.
"""

from torchrec_bagpipe._native import C

BagPipeCacheMetadata = C.BagPipeCacheMetadata
StepPlanner = C.StepPlanner

__all__ = ["BagPipeCacheMetadata", "StepPlanner"]
