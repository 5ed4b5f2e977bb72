// CacheMetadata (cache_metadata.h): construction, the per-key calls that are not a step's
// batch (lookup, residency, versions, pins, note_uses, invalidation), clearing, and what
// tests and debugging inspect. The batch calls live in cache_metadata_query.cc and
// cache_metadata_admit.cc, the queues in cache_metadata_queues.cc.
#include "cache/cache_metadata.h"

#include <algorithm>
#include <string>

#include "cache/cache_metadata_checks.h"
#include "cache/cache_metadata_probe.h"
#include "common/errors.h"

namespace bagpipe::cache {

using namespace metadata_detail;
using metadata_checks::CheckSlotRange;
using metadata_checks::CheckStep32;

EvictionPolicy ParseEvictionPolicy(const std::string& name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "oracle") return EvictionPolicy::kOracle;
  throw ValueError("eviction policy must be 'lru' or 'oracle', got '" + name + "'");
}

bool CacheMetadata::UsesDirectIndex(int64_t capacity_rows, int64_t key_bound) {
  if (key_bound < 1) return false;
  return key_bound <= kDirectIndexMaxKeys ||
         key_bound <= kDirectIndexKeysPerSlot * std::max<int64_t>(capacity_rows, 0);
}

CacheMetadata::CacheMetadata(int64_t capacity_units, EvictionPolicy policy, int64_t key_bound)
    : capacity_rows_(capacity_units * kRowsPerUnit),
      policy_(policy),
      key_bound_(key_bound),
      direct_(UsesDirectIndex(capacity_units * kRowsPerUnit, key_bound)) {
  if (capacity_units < 1) {
    throw ValueError("capacity_units must be >= 1 (units of 64 rows), got " +
                     std::to_string(capacity_units));
  }
  if (capacity_units > INT32_MAX / kRowsPerUnit) {
    throw ValueError("capacity_units too large: at most 2^31 rows per cache");
  }
  if (key_bound != kUnboundedKeys && key_bound < 1) {
    throw ValueError("key_bound must be >= 1 (the table's rows) or unbounded (-1), got " +
                     std::to_string(key_bound));
  }
  slots_ = HugeArray<SlotRec>(static_cast<size_t>(capacity_rows_));
  if (direct_) {
    direct_index_ = DirectIndex(key_bound);
    bits_ = KeyBits(key_bound);
  } else {
    map_ = SlotMap(static_cast<size_t>(capacity_rows_));
  }
  free_.reserve(static_cast<size_t>(capacity_rows_));
  Clear();
}

void CacheMetadata::CheckKeys(const int64_t* keys, size_t n, const char* what) const {
  metadata_checks::CheckKeyRange(keys, n, key_bound_, what);
}

void CacheMetadata::Lookup(const int64_t* keys, size_t n, int64_t* out_slots) const {
  if (key_bound_ != kUnboundedKeys) CheckKeys(keys, n, "lookup");
  WithIndex([&](const auto& index) {
    Probe(index, keys, n, [&](size_t i, int32_t slot, uint64_t) { out_slots[i] = slot; });
  });
}

void CacheMetadata::Resident(const int64_t* keys, const int64_t* versions, size_t n,
                             int64_t* out_slots) const {
  if (key_bound_ != kUnboundedKeys) CheckKeys(keys, n, "resident");
  WithIndex([&](const auto& index) {
    Probe(index, keys, n, [&](size_t i, int32_t slot, uint64_t) {
      out_slots[i] = slot >= 0 && slots_[slot].version == versions[i] ? slot : -1;
    });
  });
}

int64_t CacheMetadata::CountUnknownNextUses(const int64_t* keys, size_t n) const {
  if (policy_ != EvictionPolicy::kOracle) return 0;
  if (key_bound_ != kUnboundedKeys) CheckKeys(keys, n, "count_unknown_next_uses");
  int64_t count = 0;
  WithIndex([&](const auto& index) {
    Probe(index, keys, n, [&](size_t, int32_t slot, uint64_t) {
      if (slot >= 0 && slots_[slot].next_use == kNever32) ++count;
    });
  });
  return count;
}

void CacheMetadata::SetVersion(const int64_t* slots, size_t n, int64_t version) {
  CheckSlotRange(slots, n, capacity_rows_, "set_version");
  CheckStep32(version, "set_version", "version");
  for (size_t i = 0; i < n; ++i) {
    if (i + kApplyAhead < n) __builtin_prefetch(&slots_[slots[i + kApplyAhead]]);
    if (slots_[slots[i]].state != SlotState::kReady) {
      throw ValueError("set_version: slot " + std::to_string(slots[i]) + " is free");
    }
  }
  for (size_t i = 0; i < n; ++i) slots_[slots[i]].version = static_cast<int32_t>(version);
}

void CacheMetadata::Pin(const int64_t* slots, size_t n, int64_t pin_step) {
  CheckSlotRange(slots, n, capacity_rows_, "pin");
  CheckStep32(pin_step, "pin", "pin_step");
  for (size_t i = 0; i < n; ++i) {
    if (i + kApplyAhead < n) __builtin_prefetch(&slots_[slots[i + kApplyAhead]]);
    if (slots_[slots[i]].state != SlotState::kReady) {
      throw ValueError("pin: slot " + std::to_string(slots[i]) + " is free");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    PinSlot(static_cast<int32_t>(slots[i]), static_cast<int32_t>(pin_step));
  }
  FinishCall();
}

void CacheMetadata::NoteUses(const int64_t* keys, size_t n, int64_t step) {
  if (policy_ != EvictionPolicy::kOracle) return;
  CheckStep32(step, "note_uses", "step");
  if (key_bound_ != kUnboundedKeys) CheckKeys(keys, n, "note_uses");
  const int32_t use = static_cast<int32_t>(step);
  found_.resize(n);
  WithIndex([&](const auto& index) {
    Probe(index, keys, n, [&](size_t i, int32_t slot, uint64_t) { found_[i] = slot; });
  });
  for (size_t i = 0; i < n; ++i) {
    if (i + kApplyAhead < n && found_[i + kApplyAhead] >= 0) {
      __builtin_prefetch(&slots_[found_[i + kApplyAhead]]);
    }
    const int32_t slot = found_[i];
    if (slot < 0 || slots_[slot].next_use <= use) continue;
    SetNextUse(slot, use);
  }
  FinishCall();
}

std::vector<int64_t> CacheMetadata::Invalidate(const int64_t* keys, size_t n) {
  if (key_bound_ != kUnboundedKeys) CheckKeys(keys, n, "invalidate");
  found_.resize(n);
  WithIndex([&](const auto& index) {
    Probe(index, keys, n, [&](size_t i, int32_t slot, uint64_t) { found_[i] = slot; });
  });
  std::vector<int64_t> freed;
  for (size_t i = 0; i < n; ++i) {
    const int32_t slot = found_[i];
    // A key repeated in the input was freed at its first occurrence.
    if (slot < 0 || slots_[slot].key != keys[i]) continue;
    FreeSlot(slot);
    freed.push_back(slot);
    ++stats_.invalidations;
  }
  FinishCall();
  return freed;
}

void CacheMetadata::Clear() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    slots_[i] = SlotRec{kEmptyKey, -1, kNever32, -1, 0, 0, SlotState::kFree, false, false};
  }
  map_.Clear();
  direct_index_.Clear();
  buckets_.Clear();
  pinned_.clear();
  queued_ = pushes_ = 0;
  purge_pending_ = false;
  victims_.clear();
  gather_queue_ = nullptr;
  free_.clear();
  for (int64_t s = capacity_rows_ - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

MetadataStats CacheMetadata::Stats() const {
  MetadataStats st = stats_;
  st.capacity_rows = capacity_rows_;
  st.resident = size();
  st.pinned = 0;
  const PinnedLive plive = pinned_live();
  for (const QueueEntry& e : pinned_) {
    if (plive(e) && IsPinned(slots_[e.slot])) ++st.pinned;
  }
  st.memory_bytes = static_cast<int64_t>(
      slots_.memory_bytes() + map_.memory_bytes() + direct_index_.memory_bytes() +
      bits_.memory_bytes() + free_.capacity() * sizeof(int32_t) +
      buckets_.memory_bytes() + pinned_.capacity() * sizeof(QueueEntry) + seen_.memory_bytes() +
      found_.capacity() * sizeof(int32_t) + hash_.capacity() * sizeof(uint64_t) +
      victims_.capacity() * sizeof(Victim));
  return st;
}

CacheMetadata::SlotView CacheMetadata::Slot(int64_t slot) const {
  if (slot < 0 || slot >= capacity_rows_) {
    throw ValueError("slot " + std::to_string(slot) + " outside [0, " +
                     std::to_string(capacity_rows_) + ")");
  }
  const SlotRec& s = slots_[static_cast<size_t>(slot)];
  return {s.key, s.state, s.version, s.next_use == kNever32 ? kNever : s.next_use, s.pin_step};
}

void CacheMetadata::ResidentSlots(std::vector<int64_t>* keys,
                                  std::vector<int64_t>* slots) const {
  keys->clear();
  slots->clear();
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state != SlotState::kReady) continue;
    keys->push_back(slots_[i].key);
    slots->push_back(static_cast<int64_t>(i));
  }
}

std::vector<int64_t> CacheMetadata::VictimOrder() const {
  std::vector<int64_t> order;
  const QueuedLive live = queued_live();
  buckets_.ForEach(policy_ == EvictionPolicy::kOracle, [&](int32_t, const LazyQueue& q) {
    q.ForEachLive(live, [&](QueueEntry e) { order.push_back(e.slot); });
  });
  return order;
}

void CacheMetadata::SetGenerationPeriodForTest(uint32_t period) {
  if (period < 2 || period > (1u << 31) || (period & (period - 1)) != 0) {
    throw ValueError("generation period must be a power of two in [2, 2^31]");
  }
  gen_period_mask_ = period - 1;
}

}  // namespace bagpipe::cache
