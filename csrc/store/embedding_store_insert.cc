// Grouping an op's keys per hash shard and inserting the absent ones: GroupShard (one group
// per distinct key), Materialize (find or insert every group's key, give new keys slots and
// pages, all or nothing) and Publish (the new keys' slots and initial rows).
#include <algorithm>
#include <vector>

#include "common/errors.h"
#include "store/embedding_store_impl.h"
#include "store/init.h"

namespace bagpipe::store {

// Deduplicates the shard's routed items into groups (first-occurrence order), links each
// item to the next occurrence of its key, and prefetches each new key's home bucket for the
// probe pass that follows.
void EmbeddingStore::Impl::GroupShard(Shard& sh, const int64_t* keys, uint32_t b, uint32_t e) {
  const uint32_t m = e - b;
  size_t table_size = 16;
  while (table_size < 2 * static_cast<size_t>(m)) table_size <<= 1;
  const uint64_t mask = table_size - 1;
  constexpr uint32_t kFree = 0xFFFFFFFFu;
  sh.dedupe.assign(table_size, kFree);
  sh.groups.clear();
  sh.groups.reserve(m);
  sh.item_group.resize(m);
  sh.next_item.resize(m);
  sh.deferred.reserve(m);
  // Size the update scratch now, while a failure can still be rolled back: nothing in the
  // write phase allocates.
  if (sh.acc.size() < static_cast<size_t>(dim_)) sh.acc.resize(dim_);
  // Room to align the kernels' scratch (UpdateShard) to kScratchAlign bytes.
  const size_t scratch = KernelScratchFloats(dim_, PaddedDim(dim_)) + kScratchAlign / sizeof(float);
  if (sh.scratch.size() < scratch) sh.scratch.resize(scratch);
  const KeyMap::View v = sh.map.view();
  uint32_t* table = sh.dedupe.data();
  uint32_t* next_item = sh.next_item.data();
  for (uint32_t k = 0; k < m; ++k) {
    const uint32_t i = order_[b + k];
    const int64_t key = keys[i];
    const uint64_t h = hashes_[i];
    next_item[k] = Shard::kNoItem;
    for (uint64_t t = h & mask;; t = (t + 1) & mask) {
      const uint32_t g = table[t];
      if (g == kFree) {
        const uint32_t ng = static_cast<uint32_t>(sh.groups.size());
        table[t] = ng;
        sh.item_group[k] = ng;
        sh.groups.push_back({key, h, KeyMap::kPendingSlot, 1, k, k});
        __builtin_prefetch(v.bucket(v.Home(h)));
        break;
      }
      Shard::Group& grp = sh.groups[g];
      if (grp.key == key) {
        ++grp.count;
        next_item[grp.last] = k;
        grp.last = k;
        sh.item_group[k] = g;
        break;
      }
    }
  }
}

// Groups every shard's routed keys and finds or inserts each distinct key: fills the
// groups' slots, gives new keys slots and secures their pages. New keys stay pending in the
// maps until Publish. On any exception the maps and allocators are as before the call.
void EmbeddingStore::Impl::Materialize(const int64_t* keys) {
  for (auto& sh : shards_) {
    sh->fresh.clear();
    sh->groups.clear();
  }
  const size_t free_before = free_slots_.size();
  const uint32_t next_before = next_slot_;
  try {
    RunShards([&](Shard& sh, uint32_t b, uint32_t e) {
      GroupShard(sh, keys, b, e);
      FindOrInsertGroups(sh);
    });
    if (!GiveFreshSlots(free_before)) return;
  } catch (...) {
    ForgetFreshKeys(next_before);
    throw;
  }
  ++mutations_;
}

// Probes every group read-only (home buckets were prefetched by GroupShard; a key past its
// home bucket is deferred behind a prefetch of the next one), starts each found row's miss
// for the write phase, then inserts the absent keys in group order (pending, in sh.fresh).
void EmbeddingStore::Impl::FindOrInsertGroups(Shard& sh) {
  const KeyMap::View v = sh.map.view();
  const size_t ng = sh.groups.size();
  Shard::Group* groups = sh.groups.data();
  sh.deferred.clear();
  auto found = [&](Shard::Group& grp, uint32_t slot) {
    grp.slot = slot;
    if (slot == KeyMap::kNotFound) return;
    const char* r = Row(slot);
    __builtin_prefetch(r, 1);
    if (stride_ > 64) __builtin_prefetch(r + 64, 1);
    if (state_stride_ != 0) __builtin_prefetch(State(slot), 1);
  };
  for (size_t g = 0; g < ng; ++g) {
    Shard::Group& grp = groups[g];
    const size_t home = v.Home(grp.hash);
    const KeyMap::Entry* bucket = v.bucket(home);
    const KeyMap::Match mt = KeyMap::MatchBucket(bucket, grp.key);
    if (mt.hit != 0) {
      found(grp, bucket[KeyMap::EntryOf(__builtin_ctz(mt.hit))].tag - 1);
    } else if (mt.empty != 0) {
      grp.slot = KeyMap::kNotFound;
    } else {
      sh.deferred.push_back(static_cast<uint32_t>(g));  // reserved by GroupShard
      __builtin_prefetch(v.bucket(v.Next(home)));
    }
  }
  for (const uint32_t g : sh.deferred) {
    Shard::Group& grp = groups[g];
    found(grp, v.FindFrom(v.Next(v.Home(grp.hash)), grp.key));
  }
  for (size_t g = 0; g < ng; ++g) {
    Shard::Group& grp = sh.groups[g];
    if (grp.slot != KeyMap::kNotFound) continue;
    if (sh.fresh.size() == sh.fresh.capacity()) {  // so push_back below cannot throw
      sh.fresh.reserve(std::max<size_t>(16, 2 * sh.fresh.capacity()));
    }
    // Strong guarantee on bad_alloc; the entry stays valid until the next growth.
    const size_t entry = sh.map.Insert(grp.key, grp.hash, KeyMap::kPendingSlot);
    sh.fresh.push_back({static_cast<uint32_t>(g), entry, sh.map.capacity()});
    grp.slot = KeyMap::kPendingSlot;
  }
}

// Slots for the new keys in shard order, then first-occurrence order (deterministic):
// reused ones first, then fresh ones, with their pages secured. Returns false if the op
// inserted no key.
bool EmbeddingStore::Impl::GiveFreshSlots(size_t free_before) {
  size_t fresh = 0;
  for (auto& sh : shards_) fresh += sh->fresh.size();
  if (fresh == 0) return false;
  const size_t reused = std::min(fresh, free_before);
  if (static_cast<uint64_t>(next_slot_) + (fresh - reused) > uint64_t{KeyMap::kMaxSlot} + 1) {
    throw ValueError("keys: the store would pass its maximum of 2^32-3 rows");
  }
  size_t taken = 0;  // the free list shrinks only once everything is secured (below)
  for (auto& sh : shards_) {
    for (const auto& f : sh->fresh) {
      sh->groups[f.group].slot =
          taken < reused ? free_slots_[free_before - 1 - taken++] : next_slot_++;
    }
  }
  const size_t want = index_.PagesFor(next_slot_);
  if (want > page_addr_.size()) {
    spill_.MakeRoom(want - page_addr_.size());
    page_addr_.reserve(want);
    pages_.reserve(want);
    dirty_.reserve(want);
    while (page_addr_.size() < want) {
      auto dirty = std::make_unique<uint8_t[]>(index_.rows());  // zeroed: nothing dirty
      PageArena::Page* page = arena_.Allocate(epoch_);
      page_addr_.push_back(page->addr);
      pages_.push_back(page);
      dirty_.push_back(std::move(dirty));
    }
  }
  free_slots_.resize(free_before - reused);
  return true;
}

// Undoes a failed Materialize in reverse: pending keys leave the maps, slots return to the
// allocator. Pages mapped already stay (empty pages are harmless and will be used).
void EmbeddingStore::Impl::ForgetFreshKeys(uint32_t next_before) {
  for (auto& sh : shards_) {
    for (auto it = sh->fresh.rbegin(); it != sh->fresh.rend(); ++it) {
      const Shard::Group& grp = sh->groups[it->group];
      sh->map.Erase(grp.key, grp.hash);
    }
    sh->fresh.clear();
  }
  next_slot_ = next_before;
}

// Publishes the slots of this op's new keys in the map and writes their initial rows (when
// `init_rows`) and initial optimizer state (when `init_state`). Cannot fail: the pages were
// secured by Materialize.
void EmbeddingStore::Impl::Publish(Shard& sh, bool init_rows, bool init_state, uint32_t epoch) {
  const bool track = spill_.tracking();
  init_state = init_state && state_dim_ > 0;
  for (const auto& f : sh.fresh) {
    const Shard::Group& grp = sh.groups[f.group];
    if (sh.map.capacity() == f.capacity) {
      sh.map.SetSlotAt(f.bucket, grp.slot);
    } else {
      sh.map.SetSlot(grp.key, grp.hash, grp.slot);
    }
    if (init_rows) {
      InitRow(opt_.init, dim_, grp.key, grp.hash, reinterpret_cast<float*>(Row(grp.slot)));
    }
    if (init_state) FillInitialState(reinterpret_cast<float*>(State(grp.slot)));
    MarkDirty(sh, grp.slot, grp.key);
    if (track) Touch(grp.slot, epoch);
  }
}

}  // namespace bagpipe::store
