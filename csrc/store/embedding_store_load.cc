// EmbeddingStore::Load and ReadCheckpointMeta: a store rebuilt from a checkpoint written by
// EmbeddingStore::Save, through the public API only (Assign with and without state), after
// the manifest's expectations (dim, init, optimizer) are checked against the caller's.
#include <algorithm>
#include <optional>
#include <vector>

#include "common/errors.h"
#include "store/checkpoint.h"
#include "store/embedding_store.h"

namespace bagpipe::store {

std::unique_ptr<EmbeddingStore> EmbeddingStore::Load(const std::string& dir,
                                                     const LoadOverrides& ov,
                                                     std::map<std::string, std::string>* meta) {
  CheckpointReader reader(dir);
  const Manifest& m = reader.manifest();
  if (ov.dim && *ov.dim != m.dim) {
    throw ValueError("dim: the checkpoint in " + dir + " has dim " + std::to_string(m.dim) +
                     ", expected " + std::to_string(*ov.dim) + " (mismatched checkpoint)");
  }
  if (ov.init && !(*ov.init == m.init)) {
    throw ValueError("init: the checkpoint in " + dir +
                     " was written with a different initialisation (kind, bound, value or "
                     "seed); mismatched checkpoint");
  }
  // The state is read only from a full checkpoint, loaded fully, by the same optimizer.
  const bool weights_only = ov.weights_only || m.weights_only;
  if (ov.optimizer) ValidateOptimizerSpec(*ov.optimizer);
  if (ov.optimizer && !weights_only) {
    const std::string field = OptimizerSpecDifference(m.optimizer, *ov.optimizer);
    if (!field.empty()) {
      throw ValueError(field + ": the checkpoint in " + dir + " was written by optimizer '" +
                       OptimizerKindName(m.optimizer.kind) + "', and the requested optimizer ('" +
                       OptimizerKindName(ov.optimizer->kind) + "') differs in " + field +
                       "; open it with the checkpoint's optimizer, or weights_only to start "
                       "a new optimizer from its initial state");
    }
  }
  StoreOptions o;
  o.dim = m.dim;
  o.init = m.init;
  o.optimizer = ov.optimizer.value_or(m.optimizer);
  o.key_bound = ov.key_bound.value_or(m.key_bound);
  o.num_shards = ov.num_shards.value_or(m.num_shards);
  o.page_rows = ov.page_rows.value_or(m.page_rows);
  if (ov.num_threads) o.num_threads = *ov.num_threads;
  if (ov.memory_budget) o.memory_budget = *ov.memory_budget;
  if (ov.spill_dir) o.spill_dir = *ov.spill_dir;
  if (ov.high_watermark) o.high_watermark = *ov.high_watermark;
  if (ov.low_watermark) o.low_watermark = *ov.low_watermark;
  auto store = std::make_unique<EmbeddingStore>(o);
  // DecodeManifest checked m.state_dim == StateDim(m.optimizer.kind, m.dim).
  const size_t state_dim = static_cast<size_t>(m.state_dim);
  const bool read_state = !weights_only && state_dim > 0;
  store->Reserve(m.rows);
  constexpr size_t kChunk = 65536;
  std::vector<int64_t> keys(kChunk);
  std::vector<float> rows(kChunk * static_cast<size_t>(m.dim));
  std::vector<float> state(read_state ? kChunk * state_dim : 0);
  for (const SegmentEntry& seg : m.segments) {
    CheckpointReader::File kf = reader.Open(seg.keys);
    CheckpointReader::File rf = reader.Open(seg.rows);
    std::optional<CheckpointReader::File> sf;
    if (seg.has_state) {
      // Opening checks the size; an ignored state (weights-only load) is not read further.
      CheckpointReader::File f = reader.Open(seg.state);
      if (read_state) sf.emplace(std::move(f));
    }
    for (uint64_t done = 0; done < seg.count;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, seg.count - done));
      const size_t row_bytes = n * m.dim * sizeof(float);
      const size_t state_bytes = n * state_dim * sizeof(float);
      if (kf.Read(keys.data(), n * sizeof(int64_t)) != n * sizeof(int64_t) ||
          rf.Read(rows.data(), row_bytes) != row_bytes ||
          (sf && sf->Read(state.data(), state_bytes) != state_bytes)) {
        throw ValueError(reader.dir() + ": torn checkpoint (a data file ended early)");
      }
      store->Assign(keys.data(), n, rows.data(), sf ? state.data() : nullptr);
      done += n;
    }
    kf.Finish();
    rf.Finish();
    if (sf) sf->Finish();
  }
  if (store->Size() != m.rows) {
    throw ValueError(reader.dir() + ": corrupt checkpoint (duplicate keys: " +
                     std::to_string(store->Size()) + " distinct of " + std::to_string(m.rows) +
                     " rows)");
  }
  if (meta != nullptr) *meta = m.meta;
  return store;
}

std::map<std::string, std::string> EmbeddingStore::ReadCheckpointMeta(const std::string& dir) {
  return CheckpointReader(dir).manifest().meta;
}

}  // namespace bagpipe::store
