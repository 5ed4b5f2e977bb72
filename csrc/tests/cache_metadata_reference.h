// ReferenceCacheMetadata: the first CacheMetadata (a std::map of eviction buckets holding
// intrusive doubly linked lists, one hash map, no batching), kept as the simple reference
// the optimized cache/cache_metadata.h is compared against call by call
// (test_cache_metadata.cc). Same contract, same results; test code only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cache/cache_metadata.h"
#include "cache/flat_map.h"
#include "common/errors.h"

namespace bagpipe::cache::reference {

class ReferenceCacheMetadata {
 public:
  // REQUIRES: capacity_units >= 1 (ValueError otherwise).
  ReferenceCacheMetadata(int64_t capacity_units, EvictionPolicy policy);

  int64_t capacity_rows() const { return capacity_rows_; }
  EvictionPolicy policy() const { return policy_; }
  int64_t current_step() const { return step_; }
  int64_t size() const { return static_cast<int64_t>(map_.size()); }

  // Moves to `step`: pins with pin_step < step expire and finite next uses <= step become
  // kNever.  REQUIRES: step >= current_step().
  void Advance(int64_t step);

  // Classifies n unique keys.  A slot whose version differs from versions[i] is stale: it is
  // freed and the key reported as a miss.  Hits are touched: their next use becomes
  // next_uses[i] (< 0 means kNever) and they become most recent.
  // REQUIRES: keys unique and >= 0 (ValueError otherwise).
  QueryResult Query(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                    size_t n);

  // Gives ready slots, pinned through the current step, to keys in input order, evicting per
  // policy; candidates that find no slot are bypassed (not in the result).
  // REQUIRES: keys unique, >= 0 and not resident (ValueError otherwise).
  PlaceResult Admit(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                    size_t n);

  // For each key: its slot, or -1.
  void Lookup(const int64_t* keys, size_t n, int64_t* out_slots) const;

  // For each key: its slot if resident at versions[i], else -1 (no touch, no state change).
  void Resident(const int64_t* keys, const int64_t* versions, size_t n,
                int64_t* out_slots) const;

  // Sets the version of resident slots (after a local SGD update).  REQUIRES: each resident.
  void SetVersion(const int64_t* slots, size_t n, int64_t version);

  // Extends the pin of resident slots through `pin_step`.  REQUIRES: each resident.
  void Pin(const int64_t* slots, size_t n, int64_t pin_step);

  // Oracle bookkeeping when a step enters the window: a resident key whose next use is later
  // than `step` (or kNever) gets next use `step`.  No-op under lru.
  void NoteUses(const int64_t* keys, size_t n, int64_t step);

  // Frees the slots of the given keys; returns them (absent keys are ignored).
  std::vector<int64_t> Invalidate(const int64_t* keys, size_t n);

  // Frees every slot.
  void Clear();

  MetadataStats Stats() const;

  struct SlotView {
    int64_t key;
    SlotState state;
    int64_t version;
    int64_t next_use;
    int64_t pin_step;
  };
  SlotView Slot(int64_t slot) const;

  // Unpinned resident slots in victim order (first = next victim).  For tests and debugging.
  std::vector<int64_t> VictimOrder() const;

 private:
  struct SlotRec {
    int64_t key = kEmptyKey;
    int64_t version = -1;
    int64_t next_use = kNever;
    int64_t pin_step = -1;  // pinned while pin_step >= step_
    int64_t bucket = 0;     // key of the eviction bucket while queued
    uint64_t pin_seq = 0;   // matches the live entry of pinned_
    int32_t prev = -1;
    int32_t next = -1;
    SlotState state = SlotState::kFree;
    bool queued = false;    // in an eviction bucket (resident and unpinned)
    bool pinned = false;
  };
  struct List {
    int32_t head = -1;
    int32_t tail = -1;
  };

  bool IsPinned(const SlotRec& s) const { return s.pinned && s.pin_step >= step_; }
  int64_t BucketOf(int64_t next_use) const;
  void Enqueue(int32_t slot);
  void Dequeue(int32_t slot);
  void PinSlot(int32_t slot, int64_t pin_step);
  void FreeSlot(int32_t slot);
  // Victim slot for a candidate with `next_use`, or -1 (bypass).
  int32_t PickSlot(int64_t next_use);
  void Place(int32_t slot, int64_t key, int64_t version, int64_t next_use, int64_t pin_step,
             SlotState state);
  void CheckUniqueKeys(const int64_t* keys, size_t n, const char* what);

  const int64_t capacity_rows_;
  const EvictionPolicy policy_;
  int64_t step_ = -1;

  // Owned by this object; mutated only under the owner's serialization.
  std::vector<SlotRec> slots_;
  FlatMap<int32_t> map_;               // key -> slot
  std::vector<int32_t> free_;          // stack of free slots (top = back)
  std::map<int64_t, List> buckets_;    // eviction queues by next use (lru: one bucket)
  std::vector<std::pair<int32_t, uint64_t>> pinned_;  // (slot, pin_seq), lazily pruned
  uint64_t pin_seq_ = 0;
  StampedMap<uint8_t> seen_;           // scratch for uniqueness checks
  MetadataStats stats_;
};


ReferenceCacheMetadata::ReferenceCacheMetadata(int64_t capacity_units, EvictionPolicy policy)
    : capacity_rows_(capacity_units * kRowsPerUnit), policy_(policy) {
  if (capacity_units < 1) {
    throw ValueError("capacity_units must be >= 1 (units of 64 rows), got " +
                     std::to_string(capacity_units));
  }
  if (capacity_rows_ > INT32_MAX) {
    throw ValueError("capacity_units too large: at most 2^31 rows per cache");
  }
  slots_.resize(static_cast<size_t>(capacity_rows_));
  map_ = FlatMap<int32_t>(static_cast<size_t>(capacity_rows_));
  Clear();
}

inline int64_t ReferenceCacheMetadata::BucketOf(int64_t next_use) const {
  return policy_ == EvictionPolicy::kLru ? 0 : next_use;
}

inline void ReferenceCacheMetadata::Enqueue(int32_t slot) {
  SlotRec& s = slots_[slot];
  s.bucket = BucketOf(s.next_use);
  List& l = buckets_[s.bucket];
  s.prev = l.tail;
  s.next = -1;
  if (l.tail >= 0) {
    slots_[l.tail].next = slot;
  } else {
    l.head = slot;
  }
  l.tail = slot;
  s.queued = true;
}

inline void ReferenceCacheMetadata::Dequeue(int32_t slot) {
  SlotRec& s = slots_[slot];
  auto it = buckets_.find(s.bucket);
  List& l = it->second;
  if (s.prev >= 0) {
    slots_[s.prev].next = s.next;
  } else {
    l.head = s.next;
  }
  if (s.next >= 0) {
    slots_[s.next].prev = s.prev;
  } else {
    l.tail = s.prev;
  }
  if (l.head < 0) buckets_.erase(it);
  s.prev = s.next = -1;
  s.queued = false;
}

inline void ReferenceCacheMetadata::PinSlot(int32_t slot, int64_t pin_step) {
  SlotRec& s = slots_[slot];
  if (s.queued) Dequeue(slot);
  s.pin_step = IsPinned(s) ? std::max(s.pin_step, pin_step) : pin_step;
  s.pinned = true;
  s.pin_seq = ++pin_seq_;
  pinned_.emplace_back(slot, s.pin_seq);
}

inline void ReferenceCacheMetadata::FreeSlot(int32_t slot) {
  SlotRec& s = slots_[slot];
  if (s.queued) Dequeue(slot);
  map_.Erase(s.key);
  s = SlotRec{};
  free_.push_back(slot);
}

inline int32_t ReferenceCacheMetadata::PickSlot(int64_t next_use) {
  if (!free_.empty()) {
    int32_t slot = free_.back();
    free_.pop_back();
    return slot;
  }
  if (buckets_.empty()) return -1;
  int32_t victim = policy_ == EvictionPolicy::kLru ? buckets_.begin()->second.head
                                                   : buckets_.rbegin()->second.head;
  if (policy_ == EvictionPolicy::kOracle) {
    // Belady with bypass; among rows with no known next use (both kNever) fall back to LRU,
    // so a short window never freezes the cache against new rows.
    const int64_t v = slots_[victim].next_use;
    if (v < next_use || (v == next_use && next_use != kNever)) return -1;
  }
  return victim;
}

inline void ReferenceCacheMetadata::Place(int32_t slot, int64_t key, int64_t version, int64_t next_use,
                          int64_t pin_step, SlotState state) {
  SlotRec& s = slots_[slot];
  s.key = key;
  s.version = version;
  s.next_use = next_use;
  s.state = state;
  *map_.FindOrInsert(key, slot).first = slot;
  PinSlot(slot, pin_step);
}

inline void ReferenceCacheMetadata::CheckUniqueKeys(const int64_t* keys, size_t n, const char* what) {
  seen_.Reset(n);
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0) {
      throw ValueError(std::string(what) + ": keys[" + std::to_string(i) + "] = " +
                       std::to_string(keys[i]) + " is negative");
    }
    if (!seen_.FindOrInsert(keys[i], 0).second) {
      throw ValueError(std::string(what) + ": keys must be unique, key " +
                       std::to_string(keys[i]) + " repeats at position " + std::to_string(i));
    }
  }
}

inline void ReferenceCacheMetadata::Advance(int64_t step) {
  if (step < step_) {
    throw ValueError("Advance: step " + std::to_string(step) + " is before the current step " +
                     std::to_string(step_));
  }
  step_ = step;
  std::vector<std::pair<int32_t, uint64_t>> keep;
  keep.reserve(pinned_.size());
  for (const auto& [slot, seq] : pinned_) {
    SlotRec& s = slots_[slot];
    if (!s.pinned || s.pin_seq != seq) continue;  // superseded entry
    if (s.pin_step >= step_) {
      keep.emplace_back(slot, seq);
      continue;
    }
    s.pinned = false;
    if (s.next_use <= step_) s.next_use = kNever;
    Enqueue(slot);
  }
  pinned_.swap(keep);
  if (policy_ == EvictionPolicy::kOracle) {
    while (!buckets_.empty() && buckets_.begin()->first <= step_) {
      List l = buckets_.begin()->second;
      buckets_.erase(buckets_.begin());
      for (int32_t slot = l.head; slot >= 0;) {
        int32_t nxt = slots_[slot].next;
        slots_[slot].queued = false;
        slots_[slot].next_use = kNever;
        Enqueue(slot);
        slot = nxt;
      }
    }
  }
}

inline QueryResult ReferenceCacheMetadata::Query(const int64_t* keys, const int64_t* versions,
                                 const int64_t* next_uses, size_t n) {
  CheckUniqueKeys(keys, n, "query");
  QueryResult r;
  for (size_t i = 0; i < n; ++i) {
    const int32_t* found = map_.Find(keys[i]);
    if (found == nullptr) {
      r.miss_pos.push_back(static_cast<int64_t>(i));
      continue;
    }
    const int32_t slot = *found;
    SlotRec& s = slots_[slot];
    if (s.version != versions[i]) {
      ++r.stale;
      ++stats_.stale;
      FreeSlot(slot);
      r.miss_pos.push_back(static_cast<int64_t>(i));
      continue;
    }
    s.next_use = next_uses[i] < 0 ? kNever : next_uses[i];
    if (s.queued) {
      Dequeue(slot);
      Enqueue(slot);
    }
    r.hit_pos.push_back(static_cast<int64_t>(i));
    r.hit_slots.push_back(slot);
  }
  return r;
}

inline PlaceResult ReferenceCacheMetadata::Admit(const int64_t* keys, const int64_t* versions,
                                 const int64_t* next_uses, size_t n) {
  CheckUniqueKeys(keys, n, "admit");
  for (size_t i = 0; i < n; ++i) {
    if (map_.Find(keys[i]) != nullptr) {
      throw ValueError("admit: key " + std::to_string(keys[i]) + " is already resident");
    }
  }
  PlaceResult r;
  for (size_t i = 0; i < n; ++i) {
    int64_t nu = next_uses[i] < 0 ? kNever : next_uses[i];
    int32_t slot = PickSlot(nu);
    if (slot < 0) {
      ++stats_.bypassed;
      r.bypassed.push_back(static_cast<int64_t>(i));
      continue;
    }
    if (slots_[slot].state != SlotState::kFree) {
      r.evicted_keys.push_back(slots_[slot].key);
      ++stats_.evictions;
      FreeSlot(slot);
      free_.pop_back();  // FreeSlot pushed it; it is taken right away
    }
    Place(slot, keys[i], versions[i], nu, step_, SlotState::kReady);
    ++stats_.admitted;
    r.pos.push_back(static_cast<int64_t>(i));
    r.slots.push_back(slot);
  }
  return r;
}

namespace ref_detail {
inline void CheckSlotRange(const int64_t* slots, size_t n, int64_t capacity, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    if (slots[i] < 0 || slots[i] >= capacity) {
      throw ValueError(std::string(what) + ": slot " + std::to_string(slots[i]) +
                       " outside [0, " + std::to_string(capacity) + ")");
    }
  }
}
}  // namespace ref_detail

inline void ReferenceCacheMetadata::Lookup(const int64_t* keys, size_t n, int64_t* out_slots) const {
  for (size_t i = 0; i < n; ++i) {
    const int32_t* slot = map_.Find(keys[i]);
    out_slots[i] = slot ? *slot : -1;
  }
}

inline void ReferenceCacheMetadata::Resident(const int64_t* keys, const int64_t* versions, size_t n,
                             int64_t* out_slots) const {
  for (size_t i = 0; i < n; ++i) {
    const int32_t* slot = map_.Find(keys[i]);
    const bool ok = slot && slots_[*slot].version == versions[i];
    out_slots[i] = ok ? *slot : -1;
  }
}

inline void ReferenceCacheMetadata::SetVersion(const int64_t* slots, size_t n, int64_t version) {
  ref_detail::CheckSlotRange(slots, n, capacity_rows_, "set_version");
  for (size_t i = 0; i < n; ++i) {
    if (slots_[slots[i]].state != SlotState::kReady) {
      throw ValueError("set_version: slot " + std::to_string(slots[i]) + " is free");
    }
  }
  for (size_t i = 0; i < n; ++i) slots_[slots[i]].version = version;
}

inline void ReferenceCacheMetadata::Pin(const int64_t* slots, size_t n, int64_t pin_step) {
  ref_detail::CheckSlotRange(slots, n, capacity_rows_, "pin");
  for (size_t i = 0; i < n; ++i) {
    if (slots_[slots[i]].state != SlotState::kReady) {
      throw ValueError("pin: slot " + std::to_string(slots[i]) + " is free");
    }
  }
  for (size_t i = 0; i < n; ++i) PinSlot(static_cast<int32_t>(slots[i]), pin_step);
}

inline void ReferenceCacheMetadata::NoteUses(const int64_t* keys, size_t n, int64_t step) {
  if (policy_ != EvictionPolicy::kOracle) return;
  for (size_t i = 0; i < n; ++i) {
    const int32_t* slot = map_.Find(keys[i]);
    if (slot == nullptr) continue;
    SlotRec& s = slots_[*slot];
    if (s.next_use <= step) continue;
    s.next_use = step;
    if (s.queued) {
      Dequeue(*slot);
      Enqueue(*slot);
    }
  }
}

inline std::vector<int64_t> ReferenceCacheMetadata::Invalidate(const int64_t* keys, size_t n) {
  std::vector<int64_t> freed;
  for (size_t i = 0; i < n; ++i) {
    const int32_t* slot = map_.Find(keys[i]);
    if (slot == nullptr) continue;
    int32_t s = *slot;
    FreeSlot(s);
    freed.push_back(s);
    ++stats_.invalidations;
  }
  return freed;
}

inline void ReferenceCacheMetadata::Clear() {
  for (auto& s : slots_) s = SlotRec{};
  map_.Clear();
  buckets_.clear();
  pinned_.clear();
  free_.clear();
  free_.reserve(slots_.size());
  for (int64_t s = capacity_rows_ - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

inline MetadataStats ReferenceCacheMetadata::Stats() const {
  MetadataStats st = stats_;
  st.capacity_rows = capacity_rows_;
  st.resident = static_cast<int64_t>(map_.size());
  st.pinned = 0;
  for (const auto& [slot, seq] : pinned_) {
    const SlotRec& s = slots_[slot];
    if (s.pinned && s.pin_seq == seq && IsPinned(s)) ++st.pinned;
  }
  st.memory_bytes = static_cast<int64_t>(slots_.size() * sizeof(SlotRec) + map_.memory_bytes() +
                                         free_.capacity() * sizeof(int32_t));
  return st;
}

inline ReferenceCacheMetadata::SlotView ReferenceCacheMetadata::Slot(int64_t slot) const {
  if (slot < 0 || slot >= capacity_rows_) {
    throw ValueError("slot " + std::to_string(slot) + " outside [0, " +
                     std::to_string(capacity_rows_) + ")");
  }
  const SlotRec& s = slots_[slot];
  return {s.key, s.state, s.version, s.next_use, s.pin_step};
}

inline std::vector<int64_t> ReferenceCacheMetadata::VictimOrder() const {
  std::vector<int64_t> order;
  auto emit = [&](const List& l) {
    for (int32_t s = l.head; s >= 0; s = slots_[s].next) order.push_back(s);
  };
  if (policy_ == EvictionPolicy::kLru) {
    for (const auto& [b, l] : buckets_) emit(l);
  } else {
    for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) emit(it->second);
  }
  return order;
}

}  // namespace bagpipe::cache::reference
