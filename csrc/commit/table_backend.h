// TableBackend: the INTERFACE to a table's rows that the commit coordinator needs (SGD, reads,
// bulk loads, checkpoints); TableSchema: what a table is. The production implementation is a
// store::EmbeddingStore (embedding_store_backend.h); native tests plug in a map-based
// reference model with the same arithmetic.
//
// Thread safety: the coordinator serializes every call on one TableBackend (its own mutex), so
// implementations need not be thread-safe beyond that.
//
// Invariants (inherited from store/embedding_store.h):
//   1. ApplySgd sums the gradient rows of duplicate keys in input order (first one copied),
//      divides by float(grad_divisor) when it is not 1, and sets w = w - float(lr) * g.
//      ApplySgdSegments is bitwise ApplySgd on the segments' concatenation.
//   2. Read never inserts: an absent row reads as its deterministic initial value.
//   3. A call that throws changed nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/embedding_store.h"

namespace bagpipe::commit {

// What a table is: its row width, how never-written rows read, and its key domain. (Not the
// Python TableSpec of distributed/types.py, which describes a TorchRec table.)
struct TableSchema {
  uint32_t dim = 0;
  store::InitSpec init;
  int64_t key_bound = -1;  // >= 0: keys must lie in [0, key_bound)
};

class TableBackend {
 public:
  virtual ~TableBackend() = default;
  virtual const TableSchema& schema() const = 0;
  // Applies one SGD step (invariant 1).
  // REQUIRES: grad_divisor >= 1; keys within schema().key_bound (checked by the caller).
  virtual void ApplySgd(const int64_t* keys, size_t n, const float* grads, float lr,
                        int grad_divisor) = 0;
  // ApplySgd over segs[0..count) concatenated in order. The default concatenates into
  // scratch and calls ApplySgd once; a store that can read the segments in place overrides
  // it. REQUIRES: as ApplySgd.
  virtual void ApplySgdSegments(const store::GradSegment* segs, size_t count, float lr,
                                int grad_divisor);
  // Pure read of n rows (n x dim) into out.
  virtual void Read(const int64_t* keys, size_t n, float* out) = 0;
  // Bulk load; for duplicate keys the last occurrence wins.
  virtual void Assign(const int64_t* keys, size_t n, const float* rows) = 0;
  // Crash-safe checkpoint into dir; `meta` round-trips through the loader.
  virtual void Save(const std::string& dir, const std::map<std::string, std::string>& meta) = 0;
  // Counters for stats() (rows, bytes_resident, ...).
  virtual std::map<std::string, int64_t> Stats() = 0;

 private:
  std::vector<int64_t> concat_keys_;  // the default ApplySgdSegments' scratch
  std::vector<float> concat_grads_;
};

// Creates an empty table.
using TableBackendFactory =
    std::function<std::unique_ptr<TableBackend>(const std::string& name, const TableSchema& schema)>;
// Opens a table checkpoint written by TableBackend::Save, filling *meta.
using TableBackendLoader = std::function<std::unique_ptr<TableBackend>(
    const std::string& dir, std::map<std::string, std::string>* meta)>;

}  // namespace bagpipe::commit
