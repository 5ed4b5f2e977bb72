// The write half of a chained checkpoint (embedding_store_impl.h invariant 5): the snapshot
// BeginCheckpoint took is written while other ops run. Each writer thread takes the op lock
// for one chunk of rows at a time, copies them (from the live row while it still holds the
// snapshot's bytes, else from the copy an op set aside before overwriting it), and writes
// the chunk with the lock released. Ops pay one branch per row written while no snapshot is
// open, and one row copy for the first change of each snapshot row while one is.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "store/checkpoint.h"
#include "store/embedding_store_impl.h"
#include "store/segment_files.h"
#include "store/splitmix64.h"

namespace bagpipe::store {

namespace {

// Every data file of manifest m, linked into writer from dir.
void LinkChainFiles(CheckpointWriter& writer, const std::string& dir, const Manifest& m) {
  auto segments = [&](const std::vector<SegmentEntry>& segs) {
    for (const SegmentEntry& s : segs) {
      writer.Link(dir, s.keys);
      writer.Link(dir, s.rows);
      if (s.has_state) writer.Link(dir, s.state);
    }
  };
  segments(m.segments);
  for (const IncrementEntry& inc : m.chain.increments) {
    writer.Link(dir, inc.deletions);
    segments(inc.segments);
  }
}

}  // namespace

void EmbeddingStore::Impl::CopyAside(Shard& sh, uint32_t slot) {
  const size_t width = static_cast<size_t>(dim_) + static_cast<size_t>(state_dim_);
  const size_t k = sh.aside.size() / width;
  sh.aside.resize(sh.aside.size() + width);  // capacity secured by ReserveAside
  float* dst = sh.aside.data() + k * width;
  std::memcpy(dst, Row(slot), row_bytes_);
  if (state_dim_ > 0) std::memcpy(dst + dim_, State(slot), state_bytes_);
  snap_mark_[slot] = static_cast<uint32_t>(k + 2);
}

void EmbeddingStore::Impl::ReserveAside() {
  if (snap_mark_.empty()) return;
  const size_t width = static_cast<size_t>(dim_) + static_cast<size_t>(state_dim_);
  for (uint32_t s = 0; s < num_shards_; ++s) {
    std::vector<float>& aside = shards_[s]->aside;
    const size_t need = aside.size() + (shard_begin_[s + 1] - shard_begin_[s]) * width;
    if (need > aside.capacity()) aside.reserve(std::max(need, 2 * aside.capacity()));
  }
}

void EmbeddingStore::Impl::CloseSnapshot(bool committed) {
  if (snap_ == nullptr) return;
  if (!committed) {
    // The dirty set was cleared at Begin. After a base, only a full base covers the changes
    // it held. After an increment the parent is still the directory's last complete point:
    // its rows and deletions are tracked again (a row erased since Begin is a deletion
    // already, one erased and stored again is dirty already).
    bool restored = false;
    if (snap_->incremental) {
      try {
        for (uint32_t s = 0; s < num_shards_; ++s) {
          Shard& sh = *shards_[s];
          const std::vector<int64_t>& keys = snap_->keys[s];
          const std::vector<uint32_t>& slots = snap_->slots[s];
          for (size_t j = 0; j < keys.size(); ++j) {
            if (sh.map.Find(keys[j], KeyHash(keys[j])) == slots[j]) {
              MarkDirty(sh, slots[j], keys[j]);
            }
          }
        }
        for (const int64_t k : snap_->deleted) {
          shards_[ShardOf(KeyHash(k))]->deleted.push_back(k);
        }
        chain_ = snap_->parent;
        restored = true;
      } catch (const std::bad_alloc&) {
      }
    }
    if (!restored) chain_ = ChainState{};
  }
  snap_ = nullptr;
  snap_mark_.clear();
  snap_mark_.shrink_to_fit();
  for (auto& sh : shards_) {
    sh->aside.clear();
    sh->aside.shrink_to_fit();
  }
}

void EmbeddingStore::Impl::WriteSnapshotGroup(Snapshot& snap, size_t g, const std::string& prefix,
                                              SegmentEntry& seg) {
  const bool with_state = state_dim_ > 0;
  SegmentFiles files(*snap.writer, prefix, g, with_state);
  // Rows are copied in chunks under the op lock and written with it released.
  constexpr size_t kChunk = 4096;
  const size_t dim = static_cast<size_t>(dim_), sdim = static_cast<size_t>(state_dim_);
  const size_t width = dim + sdim;
  std::vector<int64_t> kbuf(kChunk);
  std::vector<float> rbuf(kChunk * dim);
  std::vector<float> sbuf(with_state ? kChunk * sdim : 0);
  size_t used = 0;
  auto flush = [&] {
    files.Write(kbuf.data(), rbuf.data(), sbuf.data(), used, dim, sdim);
    used = 0;
  };
  const size_t first = num_shards_ * g / snap.groups, last = num_shards_ * (g + 1) / snap.groups;
  for (size_t s = first; s < last; ++s) {
    const std::vector<int64_t>& skeys = snap.keys[s];
    const std::vector<uint32_t>& sslots = snap.slots[s];
    for (size_t i = 0; i < skeys.size();) {
      const size_t take = std::min(skeys.size() - i, kChunk - used);
      {
        std::lock_guard<std::mutex> lock(mu_);
        Shard& sh = *shards_[s];
        for (size_t j = i; j < i + take; ++j, ++used) {
          const uint32_t slot = sslots[j];
          const uint32_t m = snap_mark_[slot];
          kbuf[used] = skeys[j];
          if (m >= 2) {
            const float* src = sh.aside.data() + static_cast<size_t>(m - 2) * width;
            std::memcpy(rbuf.data() + used * dim, src, row_bytes_);
            if (with_state) std::memcpy(sbuf.data() + used * sdim, src + dim, state_bytes_);
          } else {
            std::memcpy(rbuf.data() + used * dim, Row(slot), row_bytes_);
            if (with_state) std::memcpy(sbuf.data() + used * sdim, State(slot), state_bytes_);
          }
          snap_mark_[slot] = 0;  // written: later changes need no copy
        }
        if (i + take == skeys.size()) {
          // Every snapshot row of this shard is written: nothing more is set aside for it.
          sh.aside.clear();
          sh.aside.shrink_to_fit();
        }
      }
      i += take;
      if (used == kChunk) flush();
    }
  }
  flush();
  seg = files.Finish();
}

std::vector<SegmentEntry> EmbeddingStore::Impl::WriteSnapshotSegments(Snapshot& snap,
                                                                      const std::string& prefix) {
  std::vector<SegmentEntry> segments(snap.groups);
  std::atomic<size_t> next{0};
  std::mutex error_mu;
  std::exception_ptr error;
  auto work = [&] {
    for (size_t g; (g = next.fetch_add(1)) < snap.groups;) {
      try {
        WriteSnapshotGroup(snap, g, prefix, segments[g]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        next.store(snap.groups);
      }
    }
  };
  // Own threads, not pool_: the pool runs the ops this write overlaps.
  const size_t helpers =
      std::min<size_t>(snap.groups, static_cast<size_t>(opt_.num_threads)) - 1;
  std::vector<std::thread> threads;
  threads.reserve(helpers);
  for (size_t t = 0; t < helpers; ++t) {
    try {
      threads.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer threads: the groups are claimed by those running
    }
  }
  work();
  for (std::thread& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  return segments;
}

CheckpointResult EmbeddingStore::Impl::WriteSnapshot(Snapshot& snap) {
  CheckpointResult r;
  try {
    CheckpointWriter& writer = *snap.writer;
    Manifest m = ManifestHead(/*weights_only=*/false);
    m.meta = snap.meta;
    if (!snap.incremental) {
      m.segments = WriteSnapshotSegments(snap, "");
      for (const auto& seg : m.segments) m.rows += seg.count;
      m.chain.id = snap.chain_id;
      m.chain.base_step = snap.step;
      m.chain.base_meta = snap.meta;
      r.links = 1;
      r.rows = m.rows;
      r.bytes = SegmentBytes(m.segments);
    } else {
      LinkChainFiles(writer, snap.dir, snap.head);
      char prefix[32];
      std::snprintf(prefix, sizeof(prefix), "inc-%04u-", snap.index);
      IncrementEntry inc;
      inc.index = snap.index;
      inc.step = snap.step;
      inc.meta = snap.meta;
      inc.deletion_count = snap.deleted.size();
      {
        CheckpointWriter::File f = writer.Create(std::string(prefix) + "deleted.bin");
        f.Write(snap.deleted.data(), snap.deleted.size() * sizeof(int64_t));
        inc.deletions = f.Finish();
      }
      inc.segments = WriteSnapshotSegments(snap, prefix);
      for (const auto& seg : inc.segments) inc.rows += seg.count;
      inc.total_rows = snap.total_rows;
      m.rows = snap.head.rows;
      m.segments = snap.head.segments;
      m.chain = snap.head.chain;
      r.incremental = true;
      r.links = static_cast<int>(snap.index) + 1;
      r.rows = inc.rows;
      r.deletions = snap.deleted.size();
      r.bytes = IncrementBytes(inc);
      m.chain.increments.push_back(std::move(inc));
    }
    const uint64_t digest = writer.Commit(m);
    const std::string canonical = CanonicalDir(snap.dir);  // the directory exists now
    std::lock_guard<std::mutex> lock(mu_);
    chain_.digest = digest;
    if (snap.incremental) {
      chain_.chain_bytes += r.bytes;
    } else {
      chain_.dir = canonical;
      chain_.base_bytes = r.bytes;
    }
    r.base_bytes = chain_.base_bytes;
    r.chain_bytes = chain_.chain_bytes;
    CloseSnapshot(/*committed=*/true);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    CloseSnapshot(/*committed=*/false);
    throw;
  }
  snap.writer.reset();
  return r;
}

// ---- the public face ---------------------------------------------------------------------

EmbeddingStore::PendingCheckpoint::PendingCheckpoint(std::unique_ptr<State> state)
    : state_(std::move(state)) {}

EmbeddingStore::PendingCheckpoint::~PendingCheckpoint() {
  if (state_) state_->impl->AbandonSnapshot();
}

int64_t EmbeddingStore::PendingCheckpoint::step() const { return state_ ? state_->step : -1; }
bool EmbeddingStore::PendingCheckpoint::incremental() const {
  return state_ && state_->incremental;
}

CheckpointResult EmbeddingStore::PendingCheckpoint::Write() {
  if (!state_) throw ValueError("checkpoint: this pending checkpoint was written already");
  const std::unique_ptr<State> state = std::move(state_);
  return state->impl->WriteSnapshot(*state);
}

std::unique_ptr<EmbeddingStore::PendingCheckpoint> EmbeddingStore::BeginCheckpoint(
    const std::string& dir, int64_t step, const std::map<std::string, std::string>& meta,
    const ChainPolicy& policy) {
  return std::make_unique<PendingCheckpoint>(impl_->BeginCheckpoint(dir, step, meta, policy));
}

}  // namespace bagpipe::store
