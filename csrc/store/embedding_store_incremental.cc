// EmbeddingStore::Checkpoint: chained checkpoints in the style of Check-N-Run (NSDI'22).
// A full base (every row, as Save) starts a chain; each later Checkpoint into the same
// directory writes an increment: only the rows stored or changed since the previous link
// (weights and optimizer state) and the keys erased since then, committed with hard links
// to the chain's earlier files and a MANIFEST naming every link (checkpoint.h, manifest.h
// version 3). A full base is written again after policy.full_every increments, or once the
// increments would pass policy.chain_fraction of the base's bytes: the old links go away
// with the directory the new base replaces (compaction).
//
// Why the store can trust an increment: the dirty bytes (embedding_store_impl.h invariant 4)
// say which rows changed since the last commit, and the directory must still hold the very
// MANIFEST that commit wrote (its checksum), so the chain the increment extends is the one
// the dirty set is relative to. Anything else (another writer, a plain Save into the
// directory, a failed commit, a new directory) gets a full base.
#include <climits>
#include <cstdlib>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "common/errors.h"
#include "store/checkpoint.h"
#include "store/embedding_store_impl.h"
#include "store/splitmix64.h"

namespace bagpipe::store {

namespace {

void CheckPolicy(const ChainPolicy& p) {
  if (p.full_every < 1) {
    throw ValueError("full_every must be >= 1, got " + std::to_string(p.full_every));
  }
  if (!(p.chain_fraction > 0.0) || !std::isfinite(p.chain_fraction)) {
    throw ValueError("chain_fraction must be > 0 and finite");
  }
}

// The directory's canonical path when it exists (so "d", "d/" and "./d" are one chain).
std::string CanonicalDir(const std::string& dir) {
  char buf[PATH_MAX];
  if (realpath(dir.c_str(), buf) == nullptr) return dir;
  return buf;
}

uint64_t NewChainId() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = SplitMix64((uint64_t{rd()} << 32) ^ rd());
  return id;
}

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

void EmbeddingStore::Impl::ClearTracking() {
  for (auto& d : dirty_) std::fill(d.get(), d.get() + index_.rows(), uint8_t{0});
  for (auto& sh : shards_) {
    sh->dirty = 0;
    sh->deleted.clear();
    sh->deleted.shrink_to_fit();
  }
}

void EmbeddingStore::Impl::AdoptChain(const std::string& dir, const Manifest& m, uint64_t digest) {
  std::lock_guard<std::mutex> lock(mu_);
  ClearTracking();
  chain_ = ChainState{};
  chain_.open = true;
  chain_.dir = CanonicalDir(dir);
  chain_.id = m.chain.id;
  chain_.digest = digest;
  chain_.increments = static_cast<uint32_t>(m.chain.increments.size());
  chain_.step = m.chain.increments.empty() ? m.chain.base_step : m.chain.increments.back().step;
  chain_.base_bytes = SegmentBytes(m.segments);
  for (const IncrementEntry& inc : m.chain.increments) chain_.chain_bytes += IncrementBytes(inc);
}

CheckpointResult EmbeddingStore::Impl::Checkpoint(const std::string& dir, int64_t step,
                                                  const std::map<std::string, std::string>& meta,
                                                  const ChainPolicy& policy) {
  CheckPolicy(policy);
  std::lock_guard<std::mutex> lock(mu_);
  bool increment = policy.incremental && chain_.open && chain_.dir == CanonicalDir(dir) &&
                   chain_.increments < static_cast<uint32_t>(policy.full_every) &&
                   step >= chain_.step && ManifestDigest(dir) == chain_.digest;
  if (increment) {
    uint64_t dirty = 0, deleted = 0;
    for (const auto& sh : shards_) {
      dirty += sh->dirty;
      deleted += sh->deleted.size();
    }
    const uint64_t per_row = sizeof(int64_t) + row_bytes_ + state_bytes_;
    const double after = static_cast<double>(chain_.chain_bytes + dirty * per_row + deleted * 8);
    increment = after <= policy.chain_fraction * static_cast<double>(chain_.base_bytes);
  }
  return increment ? WriteIncrement(dir, step, meta) : WriteBase(dir, step, meta);
}

CheckpointResult EmbeddingStore::Impl::WriteBase(const std::string& dir, int64_t step,
                                                 const std::map<std::string, std::string>& meta) {
  CheckpointWriter writer(dir);
  Manifest m = ManifestHead(/*weights_only=*/false);
  m.meta = meta;
  m.segments = WriteSegments(writer, "", state_dim_ > 0, /*dirty_only=*/false, num_shards_);
  for (const auto& seg : m.segments) m.rows += seg.count;
  m.chain.id = NewChainId();
  m.chain.base_step = step;
  m.chain.base_meta = meta;
  const uint64_t digest = writer.Commit(m);
  // Committed: every change is in the checkpoint.
  ClearTracking();
  chain_ = ChainState{};
  chain_.open = true;
  chain_.dir = CanonicalDir(dir);
  chain_.id = m.chain.id;
  chain_.digest = digest;
  chain_.step = step;
  chain_.base_bytes = SegmentBytes(m.segments);
  CheckpointResult r;
  r.incremental = false;
  r.links = 1;
  r.rows = m.rows;
  r.bytes = chain_.base_bytes;
  r.base_bytes = chain_.base_bytes;
  return r;
}

CheckpointResult EmbeddingStore::Impl::WriteIncrement(
    const std::string& dir, int64_t step, const std::map<std::string, std::string>& meta) {
  const Manifest head = CheckpointReader(dir).manifest();
  if (head.chain.id != chain_.id || head.chain.increments.size() != chain_.increments) {
    return WriteBase(dir, step, meta);  // not the chain the dirty set is relative to
  }
  CheckpointWriter writer(dir);
  LinkChainFiles(writer, dir, head);
  const uint32_t index = chain_.increments + 1;
  char prefix[32];
  std::snprintf(prefix, sizeof(prefix), "inc-%04u-", index);

  // Keys erased since the parent and not stored again (a stored one is in the rows below).
  std::vector<int64_t> deleted;
  for (const auto& sh : shards_) {
    for (const int64_t k : sh->deleted) {
      if (sh->map.Find(k, KeyHash(k)) == KeyMap::kNotFound) deleted.push_back(k);
    }
  }
  std::sort(deleted.begin(), deleted.end());
  deleted.erase(std::unique(deleted.begin(), deleted.end()), deleted.end());
  IncrementEntry inc;
  inc.index = index;
  inc.step = step;
  inc.meta = meta;
  inc.deletion_count = deleted.size();
  {
    CheckpointWriter::File f = writer.Create(std::string(prefix) + "deleted.bin");
    f.Write(deleted.data(), deleted.size() * sizeof(int64_t));
    inc.deletions = f.Finish();
  }
  // One segment per store thread: an increment is small, and each file costs an fsync.
  const size_t groups = std::min<size_t>(num_shards_, static_cast<size_t>(pool_.num_threads()));
  inc.segments = WriteSegments(writer, prefix, state_dim_ > 0, /*dirty_only=*/true, groups);
  for (const auto& seg : inc.segments) inc.rows += seg.count;
  for (const auto& sh : shards_) inc.total_rows += sh->map.size();

  Manifest m = ManifestHead(/*weights_only=*/false);
  m.rows = head.rows;
  m.segments = head.segments;
  m.chain = head.chain;
  m.meta = meta;
  const uint64_t bytes = IncrementBytes(inc);
  const uint64_t rows = inc.rows;
  m.chain.increments.push_back(std::move(inc));
  const uint64_t digest = writer.Commit(m);
  ClearTracking();
  chain_.digest = digest;
  chain_.increments = index;
  chain_.step = step;
  chain_.chain_bytes += bytes;
  CheckpointResult r;
  r.incremental = true;
  r.links = static_cast<int>(index) + 1;
  r.rows = rows;
  r.deletions = deleted.size();
  r.bytes = bytes;
  r.base_bytes = chain_.base_bytes;
  r.chain_bytes = chain_.chain_bytes;
  return r;
}

}  // namespace bagpipe::store
