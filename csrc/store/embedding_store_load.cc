// EmbeddingStore::Load and ReadCheckpointMeta: a store rebuilt from a checkpoint written by
// EmbeddingStore::Save or Checkpoint, through the public API only (Assign with and without
// state, Erase for an increment's deletions), after the manifest's expectations (dim, init,
// optimizer) are checked against the caller's. A chain loads its base, then each increment
// in order (manifest.h version 3).
#include <algorithm>
#include <optional>
#include <vector>

#include "common/errors.h"
#include "store/checkpoint.h"
#include "store/embedding_store.h"
#include "store/embedding_store_impl.h"

namespace bagpipe::store {

namespace {

// Reads data files of a verified checkpoint into a store through its public API.
struct SegmentLoader {
  static constexpr size_t kChunk = 65536;
  const CheckpointReader& reader;
  EmbeddingStore& store;
  int dim;
  size_t state_dim;
  bool read_state;
  std::vector<int64_t> keys = std::vector<int64_t>(kChunk);
  std::vector<float> rows = std::vector<float>(kChunk * static_cast<size_t>(dim));
  std::vector<float> state = std::vector<float>(read_state ? kChunk * state_dim : 0);

  [[noreturn]] void Torn() const {
    throw ValueError(reader.dir() + ": torn checkpoint (a data file ended early)");
  }

  // Assigns every row of segs (with their state when read_state), in order.
  void Apply(const std::vector<SegmentEntry>& segs) {
    for (const SegmentEntry& seg : segs) {
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
        const size_t row_bytes = n * dim * sizeof(float);
        const size_t state_bytes = n * state_dim * sizeof(float);
        if (kf.Read(keys.data(), n * sizeof(int64_t)) != n * sizeof(int64_t) ||
            rf.Read(rows.data(), row_bytes) != row_bytes ||
            (sf && sf->Read(state.data(), state_bytes) != state_bytes)) {
          Torn();
        }
        store.Assign(keys.data(), n, rows.data(), sf ? state.data() : nullptr);
        done += n;
      }
      kf.Finish();
      rf.Finish();
      if (sf) sf->Finish();
    }
  }

  // Erases the `count` keys of file f. The file is verified (size, checksum) before any key
  // is erased, so a corrupt list erases nothing.
  void Erase(const FileEntry& f, uint64_t count) {
    CheckpointReader::File df = reader.Open(f);
    std::vector<int64_t> all(static_cast<size_t>(count));
    if (df.Read(all.data(), all.size() * sizeof(int64_t)) != all.size() * sizeof(int64_t)) Torn();
    df.Finish();
    if (!all.empty()) store.Erase(all.data(), all.size());
  }
};

}  // namespace

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
  const size_t links = 1 + m.chain.increments.size();
  if (ov.chain_links && (*ov.chain_links < 1 || static_cast<size_t>(*ov.chain_links) > links)) {
    throw ValueError("chain_links: the checkpoint in " + dir + " has " + std::to_string(links) +
                     " link(s) (a base and its increments); chain_links " +
                     std::to_string(*ov.chain_links) + " is outside [1, " +
                     std::to_string(links) + "]");
  }
  const size_t load_links = ov.chain_links ? static_cast<size_t>(*ov.chain_links) : links;
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
  SegmentLoader loader{reader, *store, m.dim, state_dim, read_state};
  loader.Apply(m.segments);
  if (store->Size() != m.rows) {
    throw ValueError(reader.dir() + ": corrupt checkpoint (duplicate keys: " +
                     std::to_string(store->Size()) + " distinct of " + std::to_string(m.rows) +
                     " rows)");
  }
  // Then each increment, in chain order: its deletions, then its rows.
  for (size_t i = 0; i + 1 < load_links; ++i) {
    const IncrementEntry& inc = m.chain.increments[i];
    try {
      loader.Erase(inc.deletions, inc.deletion_count);
      loader.Apply(inc.segments);
      if (store->Size() != inc.total_rows) {
        throw ValueError(reader.dir() + ": corrupt checkpoint (" + std::to_string(store->Size()) +
                         " rows, the manifest says " + std::to_string(inc.total_rows) + ")");
      }
    } catch (const ValueError& e) {
      const int64_t prev = i == 0 ? m.chain.base_step : m.chain.increments[i - 1].step;
      throw ValueError(std::string(e.what()) + "; increment " + std::to_string(inc.index) +
                       " (step " + std::to_string(inc.step) + ") of the chain is refused; the " +
                       std::to_string(i + 1) + " link(s) before it (step " +
                       std::to_string(prev) + ") are a complete checkpoint: load them with "
                       "chain_links=" + std::to_string(i + 1));
    }
  }
  if (meta != nullptr) {
    *meta = load_links == 1 ? m.chain.base_meta : m.chain.increments[load_links - 2].meta;
  }
  // A store that holds the whole chain, state and optimizer included, may extend it.
  if (load_links == links && !weights_only && m.chain.id != 0 &&
      o.optimizer == m.optimizer) {
    store->impl_->AdoptChain(dir, m, reader.digest());
  }
  return store;
}

std::map<std::string, std::string> EmbeddingStore::ReadCheckpointMeta(const std::string& dir) {
  return CheckpointReader(dir).manifest().meta;
}

}  // namespace bagpipe::store
