// The production TableStore: a store::EmbeddingStore per table, created with the shard's
// store defaults (threads, internal shards, DRAM budget, spill directory).
//
// Thread safety: as TableStore (the coordinator serializes calls).
#pragma once

#include <cstdint>
#include <string>

#include "commit/table_store.h"

namespace bagpipe::commit {

struct StoreDefaults {
  int num_shards = 16;           // internal hash shards of each table's store
  int num_threads = 1;           // batch-op parallelism of each table's store
  int64_t memory_budget = 0;     // per table, bytes; 0: unlimited; -1: automatic
  std::string spill_dir;         // shared by the tables (spill files are anonymous)
  double high_watermark = 0.8;
  double low_watermark = 0.6;
  uint32_t page_rows = 0;        // 0: automatic
};

TableFactory MakeStoreTableFactory(const StoreDefaults& defaults);
// Opens a table checkpoint with the defaults' runtime options (threads, budget, spill).
TableLoader MakeStoreTableLoader(const StoreDefaults& defaults);

}  // namespace bagpipe::commit
