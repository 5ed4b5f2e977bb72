// EmbeddingStore: fp32 rows of one dimension keyed by int64, the storage engine of a PS shard.
//
// Layout: N hash shards (top bits of KeyHash(key)); each shard is a KeyMap (key -> slot)
// plus a page table into one PageArena of cache-line-aligned rows. A SpillTier keeps the
// arena under a DRAM budget (spilling cold pages to disk, or refusing in memory-only mode).
//
// Thread safety:
//   Every public method may be called from any thread. Batch operations are serialized by
//   an internal mutex (one batch op at a time) and run in parallel inside, on the store's
//   own thread pool. Nothing returned by the store aliases its internal memory.
//
// Invariants:
//   1. Logically every key in the key domain has a row. A row never written reads as its
//      deterministic initial value, a pure function of (InitSpec, key, column): independent
//      of shard count, thread count, insertion order and history (init.h).
//   2. Results are bitwise independent of the thread count and the shard count: duplicate
//      keys of one ApplySgd call are summed in input order before the single update.
//   3. A call that throws has changed nothing (arguments are validated and capacity is
//      secured before the first row is written; spilling moves bytes, never values).
//   4. Resident arena bytes never exceed the memory budget after a call returns (spill mode),
//      or a call that would exceed it throws MemoryBudgetError (memory-only mode).
//   5. A row's slot is stable until it is erased; spilling moves pages to disk without
//      moving their addresses.
//
// SGD arithmetic (shared, bitwise, with the trainer caches, which use separate torch ops):
//   g = sum of the key's gradient rows in input order (the first one copied, not added to 0)
//   if grad_divisor != 1:  g = g / float(grad_divisor)        (IEEE division, fp32)
//   w = w - float(lr) * g                                      (fp32 multiply, then subtract)
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "store/init.h"
#include "store/spill.h"

namespace bagpipe::store {

struct StoreOptions {
  int dim = 0;                  // REQUIRES: > 0
  int num_shards = 16;          // internal hash shards; REQUIRES: power of two in [1, 4096]
  int num_threads = 1;          // batch-op parallelism; REQUIRES: >= 1
  InitSpec init;
  int64_t key_bound = -1;       // >= 0: keys must lie in [0, key_bound); < 0: any int64
  uint32_t page_rows = 0;       // rows per arena page, a power of two; 0: about 2 MiB pages
  int64_t memory_budget = 0;    // arena DRAM budget in bytes; 0: unlimited; -1: automatic
  std::string spill_dir;        // where pages above the budget go; empty: memory-only
  double high_watermark = 0.8;  // fraction of the budget that starts spilling
  double low_watermark = 0.6;   // fraction spilling brings residency down to
};

struct StoreStats {
  int64_t rows = 0;
  int64_t bytes_resident = 0;  // arena pages in DRAM + key maps
  int64_t bytes_maps = 0;      // key maps (part of bytes_resident; never spilled)
  int64_t bytes_spilled = 0;   // arena pages backed by spill files
  int64_t pages = 0;
  int64_t pages_spilled = 0;
  int64_t page_bytes = 0;
  int64_t spill_count = 0;     // spill passes (each moves one or more cold pages to disk)
  int64_t swap_outs = 0;       // RAM -> file page moves
  int64_t swap_ins = 0;        // file -> RAM page moves
  int64_t lookups = 0;         // keys looked up
  int64_t updates = 0;         // rows updated by ApplySgd / Assign
  int64_t memory_budget = 0;   // effective budget in bytes (0: unlimited)
};

// Options of EmbeddingStore::Load. Unset fields come from the checkpoint (shards, page
// rows, key bound) or the StoreOptions defaults (threads, budget, spill).
struct LoadOverrides {
  std::optional<int> num_shards;
  std::optional<int> num_threads;
  std::optional<int64_t> key_bound;
  std::optional<uint32_t> page_rows;
  std::optional<int64_t> memory_budget;
  std::optional<std::string> spill_dir;
  std::optional<double> high_watermark;
  std::optional<double> low_watermark;
  // Expectations: a checkpoint that disagrees is refused (ValueError naming the field).
  std::optional<int> dim;
  std::optional<InitSpec> init;
  // Load weights only, ignoring any optimizer state (inference).
  bool weights_only = false;
};

// One run of gradient rows for EmbeddingStore::ApplySgdSegments: keys[0..n) and their
// gradients (n x dim, row-major). The store only reads through the pointers.
struct GradSegment {
  const int64_t* keys = nullptr;
  const float* grads = nullptr;
  size_t n = 0;
};

class EmbeddingStore {
 public:
  // REQUIRES: options valid (throws ValueError naming the field otherwise).
  explicit EmbeddingStore(const StoreOptions& options);
  ~EmbeddingStore();
  EmbeddingStore(const EmbeddingStore&) = delete;
  EmbeddingStore& operator=(const EmbeddingStore&) = delete;

  // Options as resolved at construction (memory_budget -1 becomes the detected bytes).
  const StoreOptions& options() const;
  int dim() const;

  // Copies the rows of keys[0..n) into out (n x dim, row-major). Duplicates allowed.
  // insert_missing=false reads absent rows as their initial value without storing them.
  // REQUIRES: keys within key_bound (ValueError otherwise, nothing written).
  void Lookup(const int64_t* keys, size_t n, float* out, bool insert_missing);

  // Sets rows (n x dim) for keys; for duplicate keys the last occurrence wins.
  void Assign(const int64_t* keys, size_t n, const float* rows);

  // One SGD update per distinct key (see the header comment for the arithmetic).
  // Absent keys are materialised from their initial value first.
  // REQUIRES: grad_divisor >= 1, lr finite.
  void ApplySgd(const int64_t* keys, size_t n, const float* grads, float lr, int grad_divisor);

  // ApplySgd over the concatenation of segs[0..count) in order, without copying the
  // gradients: bitwise equal to ApplySgd on the concatenated keys and grads (duplicates
  // across segments are summed in segment order). A bad key is reported at its index in
  // the concatenation. REQUIRES: as ApplySgd; the segments' total below 2^32 rows.
  void ApplySgdSegments(const GradSegment* segs, size_t count, float lr, int grad_divisor);

  // Writes 1 to present[i] if keys[i] is stored, else 0.
  void Contains(const int64_t* keys, size_t n, uint8_t* present);

  // Removes the keys that are present; returns how many distinct keys were removed.
  size_t Erase(const int64_t* keys, size_t n);

  // Prepares key-map capacity for `total_rows` rows outside the hot path.
  void Reserve(size_t total_rows);

  size_t Size();

  // Chunked export in a deterministic order (by shard, then key-map position). Returns the
  // number of rows written into keys/rows (at most max_rows), starting at `*cursor` (0 for
  // the first chunk); *cursor advances and becomes -1 when the export is complete. A
  // mutation between chunks invalidates the export (ValueError on the next call).
  size_t Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows);

  StoreStats Stats();

  void SetSpillCallback(SpillCallback cb);

  // Crash-safe checkpoint into `dir` (format and guarantees: checkpoint.h, manifest.h).
  // `meta` is stored verbatim in the manifest (the commit layer records its committed step
  // there). weights_only: an inference export without optimizer state.
  // REQUIRES: dir absent, empty or a previous checkpoint (ValueError otherwise).
  void Save(const std::string& dir, const std::map<std::string, std::string>& meta,
            bool weights_only);

  // Opens a checkpoint written by Save; fills *meta (if not null) with its meta strings.
  // Throws ValueError for a torn, corrupt, mismatched or unknown-version checkpoint.
  static std::unique_ptr<EmbeddingStore> Load(const std::string& dir,
                                              const LoadOverrides& overrides,
                                              std::map<std::string, std::string>* meta);

  // The meta strings of a checkpoint, after verifying its manifest (not its data files).
  static std::map<std::string, std::string> ReadCheckpointMeta(const std::string& dir);

  // Initial value of key's row (n x dim), without touching the store.
  // REQUIRES: ValidateInitSpec(init) passes (ValueError otherwise), dim > 0.
  static void InitialRows(const InitSpec& init, int dim, const int64_t* keys, size_t n,
                          float* out);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bagpipe::store
