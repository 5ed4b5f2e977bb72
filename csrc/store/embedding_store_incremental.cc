// EmbeddingStore::Checkpoint: chained checkpoints in the style of Check-N-Run (NSDI'22).
// A full base (every row, as Save) starts a chain; each later Checkpoint into the same
// directory writes an increment: only the rows stored or changed since the previous link
// (weights and optimizer state) and the keys erased since then, committed with hard links
// to the chain's earlier files and a MANIFEST naming every link (checkpoint.h, manifest.h
// version 3). A full base is written again after policy.full_every increments, or once the
// increments would pass policy.chain_fraction of the base's bytes: the old links go away
// with the directory the new base replaces (compaction).
//
// Each Checkpoint is BeginCheckpoint (here: the decision and the snapshot, under the op
// lock) and then the snapshot's write (embedding_store_snapshot.cc), which other ops may
// overlap.
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

uint64_t NewChainId() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = SplitMix64((uint64_t{rd()} << 32) ^ rd());
  return id;
}

}  // namespace

std::string EmbeddingStore::Impl::CanonicalDir(const std::string& dir) {
  char buf[PATH_MAX];
  if (realpath(dir.c_str(), buf) == nullptr) return dir;
  return buf;
}

void EmbeddingStore::Impl::ClearTracking() {
  for (auto& d : dirty_) std::fill(d.get(), d.get() + index_.rows(), uint8_t{0});
  for (auto& sh : shards_) {
    sh->dirty = 0;
    sh->deleted.clear();
    sh->deleted.shrink_to_fit();
    sh->dirty_list.clear();
    sh->dirty_list.shrink_to_fit();
    sh->dirty_list_lost = false;
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
  const std::unique_ptr<Snapshot> snap = BeginCheckpoint(dir, step, meta, policy);
  return WriteSnapshot(*snap);
}

std::unique_ptr<EmbeddingStore::Impl::Snapshot> EmbeddingStore::Impl::BeginCheckpoint(
    const std::string& dir, int64_t step, const std::map<std::string, std::string>& meta,
    const ChainPolicy& policy) {
  CheckPolicy(policy);
  std::lock_guard<std::mutex> lock(mu_);
  if (snap_ != nullptr) {
    throw ValueError("checkpoint: the checkpoint of step " + std::to_string(snap_->step) +
                     " into " + snap_->dir + " is still being written; finish it first");
  }
  const std::string canonical = CanonicalDir(dir);
  bool increment = policy.incremental && chain_.open && chain_.dir == canonical &&
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
  auto snap = std::make_unique<Snapshot>();
  if (increment) {
    snap->head = CheckpointReader(dir).manifest();
    // Not the chain the dirty set is relative to: a full base.
    increment = snap->head.chain.id == chain_.id &&
                snap->head.chain.increments.size() == chain_.increments;
  }
  snap->impl = this;
  snap->writer = std::make_unique<CheckpointWriter>(dir);  // validates dir
  snap->dir = dir;
  snap->step = step;
  snap->meta = meta;
  snap->incremental = increment;
  // One segment per hash shard for a base; an increment is small, and each file costs an
  // fsync: one per store thread.
  snap->groups = increment
                     ? std::min<size_t>(num_shards_, static_cast<size_t>(pool_.num_threads()))
                     : num_shards_;

  // The rows to write (every stored one, or the dirty ones: from the shards' dirty lists)
  // with their slots, marked 1.
  std::vector<uint32_t> mark(next_slot_, 0);
  snap->keys.resize(num_shards_);
  snap->slots.resize(num_shards_);
  pool_.Run(num_shards_, [&](size_t s) {
    const Shard& sh = *shards_[s];
    if (increment && sh.dirty == 0) return;
    std::vector<int64_t>& keys = snap->keys[s];
    std::vector<uint32_t>& slots = snap->slots[s];
    keys.reserve(increment ? sh.dirty : sh.map.size());
    slots.reserve(keys.capacity());
    if (increment && !sh.dirty_list_lost) {
      // The slots that turned dirty (invariant 4), in that order; an entry is current when
      // its key still holds its slot and the slot is dirty, once (a key erased and stored
      // again into the same slot has two entries). The key test comes first: only the
      // shard whose key holds a slot reads or writes its mark.
      for (const Shard::DirtyEntry& e : sh.dirty_list) {
        if (sh.map.Find(e.key, KeyHash(e.key)) != e.slot) continue;
        if (mark[e.slot] != 0 || !IsDirty(e.slot)) continue;
        keys.push_back(e.key);
        slots.push_back(e.slot);
        mark[e.slot] = 1;
      }
      return;
    }
    const KeyMap::Entry* entries = sh.map.entries();
    for (size_t b = 0; b < sh.map.capacity(); ++b) {
      if (entries[b].tag == 0) continue;
      const uint32_t slot = entries[b].tag - 1;
      if (increment && !IsDirty(slot)) continue;
      keys.push_back(entries[b].key);
      slots.push_back(slot);
      mark[slot] = 1;
    }
  });
  if (increment) {
    // Keys erased since the parent and not stored again (a stored one is in the rows).
    for (const auto& sh : shards_) {
      for (const int64_t k : sh->deleted) {
        if (sh->map.Find(k, KeyHash(k)) == KeyMap::kNotFound) snap->deleted.push_back(k);
      }
    }
    std::sort(snap->deleted.begin(), snap->deleted.end());
    snap->deleted.erase(std::unique(snap->deleted.begin(), snap->deleted.end()),
                        snap->deleted.end());
  }
  for (const auto& sh : shards_) snap->total_rows += sh->map.size();

  // Nothing below throws: the snapshot is open, and every later change is relative to it.
  snap_mark_ = std::move(mark);
  snap_ = snap.get();
  snap->parent = chain_;
  ClearTracking();
  if (increment) {
    chain_.increments += 1;
    chain_.step = step;
    chain_.digest = 0;  // known at the commit
  } else {
    chain_ = ChainState{};
    chain_.open = true;  // keys erased from now on are deletions of the next increment
    chain_.dir = canonical;  // made canonical at the commit, once the directory exists
    chain_.id = NewChainId();
    chain_.step = step;
  }
  snap->chain_id = chain_.id;
  snap->index = chain_.increments;
  return snap;
}

}  // namespace bagpipe::store
