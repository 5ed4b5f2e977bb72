// The store's rows walked out in a deterministic order (by hash shard, then key-map
// position): the chunked Export and the crash-safe Save (checkpoint.h; Load is
// embedding_store_load.cc; Checkpoint's chained links are embedding_store_snapshot.cc).
#include <cstring>
#include <mutex>
#include <vector>

#include "common/errors.h"
#include "store/checkpoint.h"
#include "store/embedding_store_impl.h"
#include "store/segment_files.h"

namespace bagpipe::store {

size_t EmbeddingStore::Impl::Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows,
                                    float* state) {
  if (state_dim_ == 0) state = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  constexpr int kPosBits = 40;
  if (*cursor < 0) throw ValueError("export: cursor is exhausted (-1)");
  if (max_rows == 0) throw ValueError("chunk_rows must be >= 1");
  if (*cursor == 0) {
    export_mutations_ = mutations_;
  } else if (export_mutations_ != mutations_) {
    throw ValueError("export: the store changed since this export started; restart it");
  }
  uint64_t s = static_cast<uint64_t>(*cursor) >> kPosBits;
  uint64_t pos = static_cast<uint64_t>(*cursor) & ((uint64_t{1} << kPosBits) - 1);
  size_t written = 0;
  while (s < num_shards_ && written < max_rows) {
    const Shard& sh = *shards_[s];
    const KeyMap::Entry* entries = sh.map.entries();
    const size_t cap = sh.map.capacity();
    while (pos < cap && written < max_rows) {
      const KeyMap::Entry& e = entries[pos++];
      if (e.tag == 0) continue;
      keys[written] = e.key;
      std::memcpy(rows + written * static_cast<size_t>(dim_), Row(e.tag - 1), row_bytes_);
      if (state != nullptr) {
        std::memcpy(state + written * static_cast<size_t>(state_dim_), State(e.tag - 1),
                    state_bytes_);
      }
      ++written;
    }
    if (pos >= cap) {
      ++s;
      pos = 0;
    }
  }
  // Never 0 here: at least one row was written or one shard was passed.
  *cursor = s >= num_shards_ ? -1 : static_cast<int64_t>((s << kPosBits) | pos);
  return written;
}

Manifest EmbeddingStore::Impl::ManifestHead(bool weights_only) const {
  Manifest m;
  m.weights_only = weights_only;
  m.dim = dim_;
  m.init = opt_.init;
  m.key_bound = opt_.key_bound;
  m.num_shards = opt_.num_shards;
  m.page_rows = opt_.page_rows;
  m.optimizer = opt_.optimizer;
  m.state_dim = state_dim_;
  return m;
}

std::vector<SegmentEntry> EmbeddingStore::Impl::WriteSegments(CheckpointWriter& writer,
                                                              bool with_state) {
  std::vector<SegmentEntry> segments(num_shards_);
  pool_.Run(num_shards_, [&](size_t g) {
    SegmentFiles files(writer, "", g, with_state);
    // Stage rows in chunks so each file write is large.
    constexpr size_t kChunk = 4096;
    std::vector<int64_t> kbuf;
    std::vector<float> rbuf;
    std::vector<float> sbuf;
    kbuf.reserve(kChunk);
    rbuf.reserve(kChunk * static_cast<size_t>(dim_));
    if (with_state) sbuf.reserve(kChunk * static_cast<size_t>(state_dim_));
    auto flush = [&] {
      files.Write(kbuf.data(), rbuf.data(), sbuf.data(), kbuf.size(), static_cast<size_t>(dim_),
                  static_cast<size_t>(state_dim_));
      kbuf.clear();
      rbuf.clear();
      sbuf.clear();
    };
    const KeyMap& map = shards_[g]->map;
    for (size_t b = 0; b < map.capacity(); ++b) {
      const KeyMap::Entry& e = map.entries()[b];
      if (e.tag == 0) continue;
      kbuf.push_back(e.key);
      const float* r = reinterpret_cast<const float*>(Row(e.tag - 1));
      rbuf.insert(rbuf.end(), r, r + dim_);
      if (with_state) {
        const float* st = reinterpret_cast<const float*>(State(e.tag - 1));
        sbuf.insert(sbuf.end(), st, st + state_dim_);
      }
      if (kbuf.size() == kChunk) flush();
    }
    flush();
    segments[g] = files.Finish();
  });
  return segments;
}

void EmbeddingStore::Impl::Save(const std::string& dir,
                               const std::map<std::string, std::string>& meta,
                               bool weights_only) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckpointWriter writer(dir);
  Manifest m = ManifestHead(weights_only);
  m.meta = meta;
  m.segments = WriteSegments(writer, state_dim_ > 0 && !weights_only);
  for (const auto& seg : m.segments) m.rows += seg.count;
  writer.Commit(m);
}

}  // namespace bagpipe::store
