// EmbeddingStore: fp32 rows of one dimension keyed by int64, each with the state of the
// store's optimizer, the storage engine of a PS shard.
//
// Layout: N hash shards (top bits of KeyHash(key)); each shard is a KeyMap (key -> slot)
// plus a page table into one PageArena. A page holds page_rows cache-line-aligned weight
// rows, then the same rows' optimizer state (StateDim floats each; a state of 4..32 bytes is
// packed at a power-of-two stride, a larger one is cache-line aligned), so a row's state
// spills, comes back and is counted with its page, and by default weights and state share
// one 2 MiB huge page. SGD keeps no state: its pages are weight rows only, as before. A
// SpillTier keeps the arena under a DRAM budget (spilling cold pages to disk, or refusing in
// memory-only mode).
//
// Thread safety:
//   Every public method may be called from any thread. Batch operations are serialized by
//   an internal mutex (one batch op at a time) and run in parallel inside, on the store's
//   own thread pool. Nothing returned by the store aliases its internal memory.
//
// Invariants:
//   1. Logically every key in the key domain has a row. A row never written reads as its
//      deterministic initial value, a pure function of (InitSpec, key, column): independent
//      of shard count, thread count, insertion order and history (init.h); its state reads
//      as the optimizer's initial state (InitialState, optimizer.h).
//   2. Results are bitwise independent of the thread count and the shard count: duplicate
//      keys of one update call are summed in input order before the single update.
//   3. A call that throws has changed nothing (arguments are validated and capacity is
//      secured before the first row is written; spilling moves bytes, never values).
//   4. Resident arena bytes never exceed the memory budget after a call returns (spill mode),
//      or a call that would exceed it throws MemoryBudgetError (memory-only mode).
//   5. A row's slot is stable until it is erased; spilling moves pages to disk without
//      moving their addresses.
//   6. An update touches only the rows of its keys: a NaN or inf gradient poisons its own
//      row (and state) and no other.
//   7. Change tracking (incremental checkpoints, embedding_store_incremental.cc): every row
//      an op stores or changes (insert, Assign, update) is dirty until the next Checkpoint
//      that commits, or (BeginCheckpoint) until the snapshot is taken; every key erased
//      while a chain is open is a deletion until then. A Checkpoint that throws before
//      its snapshot leaves both as they were; one whose write fails (or is abandoned)
//      makes the next Checkpoint a full base.
//   8. Snapshots: between BeginCheckpoint and the end of its Write, every op runs as usual;
//      the checkpoint holds exactly the rows, state and deletions of the moment Begin
//      returned (an op copies a snapshot row aside before it first overwrites or frees it).
//
// Update arithmetic (shared, bitwise, with the trainer caches, which run the same sequence
// as separate torch ops, each rounding once in fp32; built with -ffp-contract=off). Per
// distinct key of an ApplyGradients call, with lr the call's fp32 learning rate, W its
// grad_divisor and the spec's constants rounded once to fp32 (optimizer.h):
//   1. G = the key's gradient rows summed in input order (the first copied, not added to 0).
//   2. u = G / float(W)                                       (skipped when W == 1)
//   3. u = u + w * wd                                         (only when weight_decay != 0;
//                                                              L2, as fbgemm / torch Adagrad)
//   4. SGD:             t = u * lr;  w = w - t
//   5. Adagrad:         s = s + u*u;  d = sqrt(s) + eps;  w = w - (u / d) * lr   (s per column)
//   6. Row-wise Adagrad (fbgemm EXACT_ROWWISE_ADAGRAD): r = rowsum(u*u) / float(dim);
//                       s = s + r;  d = sqrt(s) + eps;  m = lr / d;  w = w - u * m
//                       (s one float per row)
//   7. rowsum is a fixed pairwise tree: zero-pad the columns to P, the smallest power of two
//      >= dim, then x[c] = x[c] + x[c + h] for c < h, h = P/2, P/4, ..., 1; the sum is x[0].
//   8. Adam (lazy: rows absent from the call keep their state):
//                       m = m + (u - m) * c1;  v = v + (u*u - v) * c2;  d = sqrt(v) + eps;
//                       w = w - (m / d) * lr,  with c1 = float(1.0 - beta1) and
//                       c2 = float(1.0 - beta2) computed in double. The caller passes as lr
//                       the bias-corrected step size lr*sqrt(1 - beta2^t)/(1 - beta1^t),
//                       rounded to fp32: the store is step-agnostic.
//   9. sqrt is IEEE sqrt; every other step is one IEEE fp32 operation; NaN and inf follow the
//      arithmetic with no special casing.
//   10. Initial state: Adagrad kinds float(initial_accumulator_value) (default 0); Adam
//      m = v = 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "store/init.h"
#include "store/optimizer.h"
#include "store/spill.h"

namespace bagpipe::store {

struct StoreOptions {
  int dim = 0;                  // REQUIRES: > 0
  int num_shards = 16;          // internal hash shards; REQUIRES: power of two in [1, 4096]
  int num_threads = 1;          // batch-op parallelism; REQUIRES: >= 1
  InitSpec init;
  OptimizerSpec optimizer;      // REQUIRES: ValidateOptimizerSpec passes
  int64_t key_bound = -1;       // >= 0: keys must lie in [0, key_bound); < 0: any int64
  uint32_t page_rows = 0;       // rows per arena page, in [1, 2^24]; 0: automatic (SGD: a power
                                // of two, about 2 MiB of rows; with optimizer state: as many
                                // rows as fit, weights and state, in 2 MiB)
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
  int64_t updates = 0;         // rows updated by ApplyGradients / ApplySgd / Assign
  int64_t memory_budget = 0;   // effective budget in bytes (0: unlimited)
  int64_t state_dim = 0;       // optimizer state floats per row
  int64_t slot_bytes = 0;      // arena bytes of one row: weights and state, with padding
  int64_t dirty_rows = 0;      // rows changed since the last Checkpoint (invariant 7)
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
  // The optimizer to run. A full load refuses a checkpoint written with a different one
  // (ValueError naming the first differing field, OptimizerSpecDifference); unset: the
  // checkpoint's. A weights-only load (below, or of a weights-only checkpoint) may change
  // it: every row then starts from the initial state.
  std::optional<OptimizerSpec> optimizer;
  // Load weights only, ignoring any optimizer state (inference, or a new optimizer).
  bool weights_only = false;
  // Links of a chained checkpoint to load (1: the base alone, 2: the base and its first
  // increment, ...); unset: all. REQUIRES: in [1, links] (ValueError otherwise).
  std::optional<int> chain_links;
};

// When EmbeddingStore::Checkpoint writes an increment rather than a full base.
struct ChainPolicy {
  bool incremental = true;      // false: every checkpoint is a full base
  int full_every = 8;           // a full base after this many increments; REQUIRES: >= 1
  double chain_fraction = 0.5;  // a full base once the chain's increments would pass this
                                // fraction of the base's bytes; REQUIRES: > 0, finite
};

// What one EmbeddingStore::Checkpoint wrote.
struct CheckpointResult {
  bool incremental = false;  // an increment (false: a full base, the chain compacted)
  int links = 1;             // links of the chain now in the directory (the base counts 1)
  uint64_t rows = 0;         // rows written (an increment: those changed since its parent)
  uint64_t deletions = 0;    // keys recorded as erased (increments only)
  uint64_t bytes = 0;        // data bytes written (the MANIFEST not counted)
  uint64_t base_bytes = 0;   // data bytes of the chain's base
  uint64_t chain_bytes = 0;  // data bytes of the chain's increments, this one included
};

// One run of gradient rows for EmbeddingStore::ApplyGradientsSegments: keys[0..n) and their
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
  // Optimizer state floats per row (StateDim of the store's optimizer; 0 for SGD).
  int state_dim() const;

  // Copies the rows of keys[0..n) into out (n x dim, row-major) and, when state_out is not
  // null, their optimizer state into state_out (n x state_dim). Duplicates allowed.
  // insert_missing=false reads absent rows as their initial value and state without storing
  // them. REQUIRES: keys within key_bound (ValueError otherwise, nothing written).
  void Lookup(const int64_t* keys, size_t n, float* out, bool insert_missing);
  void Lookup(const int64_t* keys, size_t n, float* out, float* state_out, bool insert_missing);

  // Sets rows (n x dim) for keys; for duplicate keys the last occurrence wins. With state
  // (n x state_dim, not null) the state is set the same way; without, stored rows keep their
  // state and new rows start from the initial state.
  void Assign(const int64_t* keys, size_t n, const float* rows);
  void Assign(const int64_t* keys, size_t n, const float* rows, const float* state);

  // One update per distinct key with the store's optimizer (the arithmetic contract in the
  // header comment). Absent keys are materialised from their initial value and state first.
  // REQUIRES: grad_divisor >= 1, lr finite (ValueError otherwise, nothing written).
  void ApplyGradients(const int64_t* keys, size_t n, const float* grads, float lr,
                      int grad_divisor);

  // ApplyGradients over the concatenation of segs[0..count) in order, without copying the
  // gradients: bitwise equal to ApplyGradients on the concatenated keys and grads
  // (duplicates across segments are summed in segment order). A bad key is reported at its
  // index in the concatenation. REQUIRES: as ApplyGradients; the segments' total below 2^32
  // rows.
  void ApplyGradientsSegments(const GradSegment* segs, size_t count, float lr, int grad_divisor);

  // ApplyGradients / ApplyGradientsSegments of an SGD store.
  // REQUIRES: the store's optimizer is SGD (ValueError naming `optimizer` otherwise).
  void ApplySgd(const int64_t* keys, size_t n, const float* grads, float lr, int grad_divisor);
  void ApplySgdSegments(const GradSegment* segs, size_t count, float lr, int grad_divisor);

  // Writes 1 to present[i] if keys[i] is stored, else 0.
  void Contains(const int64_t* keys, size_t n, uint8_t* present);

  // Removes the keys that are present; returns how many distinct keys were removed.
  size_t Erase(const int64_t* keys, size_t n);

  // Prepares key-map capacity for `total_rows` rows outside the hot path.
  void Reserve(size_t total_rows);

  // Rows stored (rows read as initial values without being stored do not count).
  size_t Size();

  // Chunked export in a deterministic order (by shard, then key-map position). Returns the
  // number of rows written into keys/rows (at most max_rows), starting at `*cursor` (0 for
  // the first chunk); *cursor advances and becomes -1 when the export is complete. A
  // mutation between chunks invalidates the export (ValueError on the next call). state, when
  // not null, receives the rows' optimizer state (max_rows x state_dim).
  size_t Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows,
                float* state = nullptr);

  // Counters since construction; sizes as of now.
  StoreStats Stats();

  // cb gets one message, the first time a page spills to disk (at once if that happened
  // already; spill.h). It runs with the store's lock held (inside a batch op or this call):
  // it must not call the store.
  void SetSpillCallback(SpillCallback cb);

  // Crash-safe checkpoint into `dir` (format and guarantees: checkpoint.h, manifest.h).
  // `meta` is stored verbatim in the manifest (the shard layer records its committed step
  // there). The manifest records the optimizer spec; the state files are written unless
  // weights_only (an inference export: loading it gives every row the initial state).
  // REQUIRES: dir absent, empty or a previous checkpoint (ValueError otherwise).
  void Save(const std::string& dir, const std::map<std::string, std::string>& meta,
            bool weights_only);

  // Chained checkpoint into `dir` at `step` (the caller's count; recorded in the link):
  // an increment holding only the rows changed and the keys erased since this store's
  // previous Checkpoint into dir, when `policy` allows it and dir still holds that
  // checkpoint's MANIFEST; otherwise a full base (which compacts the chain away). Same
  // crash safety as Save: dir holds the previous complete checkpoint until the new one is
  // durable. After it, the changed rows and deletions are clean (invariant 7).
  // REQUIRES: policy valid; dir as for Save (ValueError otherwise); step >= the previous
  // link's when an increment is written (a smaller one writes a full base).
  CheckpointResult Checkpoint(const std::string& dir, int64_t step,
                              const std::map<std::string, std::string>& meta,
                              const ChainPolicy& policy);

  // A Checkpoint split in two (invariant 8): BeginCheckpoint decides base or increment,
  // validates dir and takes the snapshot (a walk of the key maps, no row copied) under the
  // op lock; Write then copies and writes the rows while other ops run, and commits.
  // Checkpoint(...) is BeginCheckpoint(...)->Write().
  class PendingCheckpoint {
   public:
    // Not written (or its Write failed): the snapshot is dropped, and the next Checkpoint
    // writes a full base; dir keeps its previous complete checkpoint.
    ~PendingCheckpoint();
    PendingCheckpoint(const PendingCheckpoint&) = delete;
    PendingCheckpoint& operator=(const PendingCheckpoint&) = delete;
    int64_t step() const;
    bool incremental() const;
    // Writes and commits the snapshot (crash safety as Checkpoint). Throws IOError.
    // REQUIRES: called at most once; the store outlives this object.
    CheckpointResult Write();

    struct State;  // the snapshot (embedding_store_impl.h)
    explicit PendingCheckpoint(std::unique_ptr<State> state);

   private:
    std::unique_ptr<State> state_;  // null once written
  };
  // REQUIRES: as Checkpoint; no other PendingCheckpoint of this store alive (ValueError).
  std::unique_ptr<PendingCheckpoint> BeginCheckpoint(
      const std::string& dir, int64_t step, const std::map<std::string, std::string>& meta,
      const ChainPolicy& policy);

  // Opens a checkpoint written by Save or Checkpoint (any version this build reads: a chain
  // is its base and then each increment, in order, bitwise the store that wrote the last
  // one); fills *meta (if not null) with the meta strings of the last link loaded. A store
  // that loaded a whole chain, with its optimizer and state, extends that chain on its next
  // Checkpoint into dir. Throws ValueError for a torn, corrupt, mismatched (dim, init,
  // optimizer: see LoadOverrides) or unknown-version checkpoint; for a corrupt increment
  // the message names the links before it that load (chain_links).
  static std::unique_ptr<EmbeddingStore> Load(const std::string& dir,
                                              const LoadOverrides& overrides,
                                              std::map<std::string, std::string>* meta);

  // The meta strings of a checkpoint, after verifying its manifest (not its data files).
  static std::map<std::string, std::string> ReadCheckpointMeta(const std::string& dir);

  // Initial value of key's row (n x dim), without touching the store.
  // REQUIRES: ValidateInitSpec(init) passes (ValueError otherwise), dim > 0.
  static void InitialRows(const InitSpec& init, int dim, const int64_t* keys, size_t n,
                          float* out);
  // The same, plus the initial optimizer state of each row into state_out
  // (n x StateDim(optimizer.kind, dim)) when it is not null.
  // REQUIRES: as above, and ValidateOptimizerSpec(optimizer) passes.
  static void InitialRows(const InitSpec& init, int dim, const OptimizerSpec& optimizer,
                          const int64_t* keys, size_t n, float* out, float* state_out);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bagpipe::store
