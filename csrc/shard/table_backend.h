// TableBackend: the INTERFACE to a table's rows that the commit coordinator needs (the
// optimizer update, reads, bulk loads, checkpoints); TableSchema: what a table is. The
// production implementation is a store::EmbeddingStore (embedding_store_backend.h); native
// tests plug in a map-based reference model with the same arithmetic.
//
// Thread safety: the coordinator serializes every call on one TableBackend (its own mutex), so
// implementations need not be thread-safe beyond that.
//
// Invariants (inherited from store/embedding_store.h):
//   1. ApplyGradients sums the gradient rows of duplicate keys in input order (first one
//      copied), divides by float(grad_divisor) when it is not 1, and applies the schema's
//      optimizer once per distinct key with the call's lr (the arithmetic contract of
//      store/embedding_store.h). ApplyGradientsSegments is bitwise ApplyGradients on the
//      segments' concatenation.
//   2. Read never inserts: an absent row reads as its deterministic initial value and state.
//   3. A call that throws changed nothing.
//   4. Rows "with state" are StateDim(schema().optimizer.kind, dim) floats wider: the
//      weights, then the row's optimizer state (the wire's row layout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/embedding_store.h"

namespace bagpipe::shard {

// What a table is: its row width, how never-written rows read, its key domain and its
// optimizer. (Not the Python TableSpec of distributed/types.py, which describes a TorchRec
// table.)
struct TableSchema {
  uint32_t dim = 0;
  store::InitSpec init;
  int64_t key_bound = -1;  // >= 0: keys must lie in [0, key_bound)
  store::OptimizerSpec optimizer;

  // Optimizer state floats per row.
  uint32_t state_dim() const {
    return static_cast<uint32_t>(store::StateDim(optimizer.kind, static_cast<int>(dim)));
  }
};

// Empty if the two schemas describe the same table; otherwise which field of `a` differs
// from `b`'s ("dim ...", "init ...", "key_bound ...", "optimizer.<field> ...").
std::string SchemaDifference(const TableSchema& a, const TableSchema& b);

class TableBackend {
 public:
  virtual ~TableBackend() = default;
  // What the table is; fixed for the backend's life.
  virtual const TableSchema& schema() const = 0;
  // Applies one optimizer step (invariant 1).
  // REQUIRES: grad_divisor >= 1; lr finite; keys within schema().key_bound (checked by the
  // caller).
  virtual void ApplyGradients(const int64_t* keys, size_t n, const float* grads, float lr,
                              int grad_divisor) = 0;
  // ApplyGradients over segs[0..count) concatenated in order. The default concatenates into
  // scratch and calls ApplyGradients once; a store that can read the segments in place
  // overrides it. REQUIRES: as ApplyGradients.
  virtual void ApplyGradientsSegments(const store::GradSegment* segs, size_t count, float lr,
                                      int grad_divisor);
  // Pure read of n rows into out: n x dim, or n x (dim + state_dim) with_state (invariant 4).
  virtual void Read(const int64_t* keys, size_t n, float* out, bool with_state) = 0;
  // Bulk load; for duplicate keys the last occurrence wins. `rows` as Read's `out`; without
  // state, stored rows keep their state and new rows start from the initial state.
  virtual void Assign(const int64_t* keys, size_t n, const float* rows, bool with_state) = 0;
  // Virtual tables: removes the rows of keys[0, n) and their optimizer state (absent keys are
  // skipped); a later touch recreates a row from its initial value. The default refuses
  // (ValueError). REQUIRES: keys within schema().key_bound (checked by the caller).
  virtual void Erase(const int64_t* keys, size_t n);
  // Chunked export of the stored rows (rows never written are not stored) with their state,
  // laid out as Read's `out` with_state, in a deterministic order: up to max_rows rows from
  // *cursor (0 for the first chunk) into keys / rows; *cursor becomes -1 when the export is
  // complete. A mutation between chunks invalidates it (ValueError on the next call).
  // The default refuses (ValueError): a backend that cannot list its rows cannot reshard.
  virtual size_t Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows);
  // Crash-safe checkpoint into dir; `meta` round-trips through the loader.
  virtual void Save(const std::string& dir, const std::map<std::string, std::string>& meta) = 0;
  // A chained checkpoint into dir at `step` (store::EmbeddingStore::Checkpoint: an increment
  // of the rows changed since the previous one into dir when `policy` allows it), in two
  // halves (store::EmbeddingStore::BeginCheckpoint): this call fixes what is written, as of
  // now; the returned writer writes and commits it, and may run on another thread while
  // later calls on this backend change rows. No other chained checkpoint may begin before
  // the writer has run (or been destroyed). The default (a backend without snapshots or
  // change tracking) is a full Save here and a writer with nothing left to do.
  // Throws as Save (either half).
  using PendingWrite = std::function<store::CheckpointResult()>;
  virtual PendingWrite BeginCheckpointChain(const std::string& dir, int64_t step,
                                            const std::map<std::string, std::string>& meta,
                                            const store::ChainPolicy& policy);
  // Both halves at once.
  store::CheckpointResult CheckpointChain(const std::string& dir, int64_t step,
                                          const std::map<std::string, std::string>& meta,
                                          const store::ChainPolicy& policy) {
    return BeginCheckpointChain(dir, step, meta, policy)();
  }
  // Counters for stats() (rows, bytes_resident, ...).
  virtual std::map<std::string, int64_t> Stats() = 0;

 private:
  std::vector<int64_t> concat_keys_;  // the default ApplyGradientsSegments' scratch
  std::vector<float> concat_grads_;
};

// Creates an empty table.
using TableBackendFactory =
    std::function<std::unique_ptr<TableBackend>(const std::string& name, const TableSchema& schema)>;
// Opens a table checkpoint written by TableBackend::Save, filling *meta.
using TableBackendLoader = std::function<std::unique_ptr<TableBackend>(
    const std::string& dir, std::map<std::string, std::string>* meta)>;

}  // namespace bagpipe::shard
