// The production TableBackend (table_backend.h): one store::EmbeddingStore per table, created
// from the shard's store options (threads, internal shards, DRAM budget, spill directory,
// watermarks, page rows) with the table's own schema (dim, init, key bound, optimizer).
//
// Thread safety: as TableBackend (the coordinator serializes calls).
//
// Invariants:
//   1. A backend's schema() is its store's dim, init, key bound and optimizer (a negative key
//      bound reads as -1): a restored table reports what its checkpoint holds.
//   2. The factory and the loader copy the options they are made from: later changes to the
//      caller's struct change nothing.
#pragma once

#include "shard/table_backend.h"
#include "store/embedding_store.h"

namespace bagpipe::shard {

// Creates empty tables: `store` with dim, init, key_bound and optimizer replaced by each
// table's schema (the rest: shards, threads, page rows, budget, spill, watermarks).
TableBackendFactory MakeEmbeddingStoreBackendFactory(const store::StoreOptions& store);
// Opens table checkpoints with `store`'s runtime options (threads, budget, spill directory
// when set, watermarks); the layout (dim, init, shards, page rows) and the optimizer come
// from the checkpoint.
TableBackendLoader MakeEmbeddingStoreBackendLoader(const store::StoreOptions& store);

}  // namespace bagpipe::shard
