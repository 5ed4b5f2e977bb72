#include "cache/cache_metadata.h"

#include <algorithm>
#include <string>

#include "common/errors.h"

namespace bagpipe::cache {

namespace {

// Software pipeline of Probe: a key is hashed and its map cell prefetched kCellAhead keys
// before its cell is probed (and its slot record prefetched), which happens kRecordAhead keys
// before the record is read. The distances cover a DRAM access at a few ns of work per key.
constexpr size_t kCellAhead = 16;
constexpr size_t kRecordAhead = 16;
constexpr size_t kRing = 64;         // > kCellAhead + kRecordAhead, a power of two
constexpr size_t kApplyAhead = 16;   // record prefetch distance of the mutating passes
constexpr size_t kVictimAhead = 16;  // victims gathered / prefetched ahead of their eviction
// Queue entries pushed beyond the live ones before the queues are compacted.
constexpr int64_t kCompactSlack = 4096;

std::string Pos(const char* what, const char* arr, size_t i, int64_t v) {
  return std::string(what) + ": " + arr + "[" + std::to_string(i) + "] = " + std::to_string(v);
}

// The checks below reduce first (vectorized) and only look for the position on failure.

void CheckKeysNonNegative(const int64_t* keys, size_t n, const char* what) {
  int64_t low = 0;
  for (size_t i = 0; i < n; ++i) low = std::min(low, keys[i]);
  if (low >= 0) return;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0) throw ValueError(Pos(what, "keys", i, keys[i]) + " is negative");
  }
}

// Next uses are stored in 32 bits with INT32_MAX as kNever32 (invariant 7).
void CheckNextUses(const int64_t* next_uses, size_t n, const char* what) {
  int64_t high = 0;
  for (size_t i = 0; i < n; ++i) high = std::max(high, next_uses[i]);
  if (high < INT32_MAX) return;
  for (size_t i = 0; i < n; ++i) {
    if (next_uses[i] >= INT32_MAX) {
      throw ValueError(Pos(what, "next_uses", i, next_uses[i]) +
                       " is not a step (next uses must be < 2^31 - 1)");
    }
  }
}

// A value stored in 32 bits (invariant 7): [INT32_MIN, INT32_MAX), INT32_MAX is kNever32.
bool Fits32(int64_t v) { return v >= INT32_MIN && v < INT32_MAX; }

void CheckVersions(const int64_t* versions, size_t n, const char* what) {
  int64_t low = 0, high = 0;
  for (size_t i = 0; i < n; ++i) {
    low = std::min(low, versions[i]);
    high = std::max(high, versions[i]);
  }
  if (Fits32(low) && Fits32(high)) return;
  for (size_t i = 0; i < n; ++i) {
    if (!Fits32(versions[i])) {
      throw ValueError(Pos(what, "versions", i, versions[i]) + " does not fit in 32 bits");
    }
  }
}

void CheckSlotRange(const int64_t* slots, size_t n, int64_t capacity, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    if (slots[i] < 0 || slots[i] >= capacity) {
      throw ValueError(std::string(what) + ": slot " + std::to_string(slots[i]) +
                       " outside [0, " + std::to_string(capacity) + ")");
    }
  }
}

void CheckStep32(int64_t v, const char* what, const char* name) {
  if (!Fits32(v)) {
    throw ValueError(std::string(what) + ": " + name + " " + std::to_string(v) +
                     " does not fit in 32 bits (steps lie in [-2^31, 2^31 - 1))");
  }
}

}  // namespace

EvictionPolicy ParseEvictionPolicy(const std::string& name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "oracle") return EvictionPolicy::kOracle;
  throw ValueError("eviction policy must be 'lru' or 'oracle', got '" + name + "'");
}

CacheMetadata::CacheMetadata(int64_t capacity_units, EvictionPolicy policy)
    : capacity_rows_(capacity_units * kRowsPerUnit), policy_(policy) {
  if (capacity_units < 1) {
    throw ValueError("capacity_units must be >= 1 (units of 64 rows), got " +
                     std::to_string(capacity_units));
  }
  if (capacity_units > INT32_MAX / kRowsPerUnit) {
    throw ValueError("capacity_units too large: at most 2^31 rows per cache");
  }
  slots_ = HugeArray<SlotRec>(static_cast<size_t>(capacity_rows_));
  map_ = SlotMap(static_cast<size_t>(capacity_rows_));
  free_.reserve(static_cast<size_t>(capacity_rows_));
  Clear();
}

// ---- queue and pin bookkeeping -------------------------------------------------------------

uint32_t CacheMetadata::Bump(SlotRec& s) {
  ++s.gen;
  // Crossing a period: stale entries of earlier generations are purged at the end of this
  // call, long before the 32-bit generation could come back to their values.
  if ((s.gen & gen_period_mask_) == 0) purge_pending_ = true;
  return s.gen;
}

void CacheMetadata::FinishCall() {
  if (purge_pending_) CompactQueues();
}

void CacheMetadata::CompactQueues() {
  const QueuedLive live = queued_live();
  buckets_.ForEachMutable([&](int32_t, LazyQueue& q) { q.Compact(live); });
  pushes_ = 0;
  if (purge_pending_) {
    purge_pending_ = false;
    const PinnedLive plive = pinned_live();
    size_t keep = 0;
    for (const QueueEntry& e : pinned_) {
      if (plive(e)) pinned_[keep++] = e;
    }
    pinned_.resize(keep);
  }
}

void CacheMetadata::Enqueue(int32_t slot) {
  SlotRec& s = slots_[slot];
  s.queued = true;
  ++queued_;
  ++pushes_;
  buckets_.Get(BucketOf(s.next_use)).Push(QueueEntry{slot, Bump(s)});
}

void CacheMetadata::SetNextUse(int32_t slot, int32_t next_use) {
  SlotRec& s = slots_[slot];
  if (!s.queued) {
    s.next_use = next_use;
    return;
  }
  Unqueue(s);
  s.next_use = next_use;
  Enqueue(slot);
}

void CacheMetadata::PinSlot(int32_t slot, int32_t pin_step) {
  SlotRec& s = slots_[slot];
  if (s.queued) Unqueue(s);
  s.pin_step = IsPinned(s) ? std::max(s.pin_step, pin_step) : pin_step;
  s.pinned = true;
  pinned_.push_back(QueueEntry{slot, Bump(s)});
}

void CacheMetadata::FreeSlot(int32_t slot) {
  SlotRec& s = slots_[slot];
  if (s.queued) Unqueue(s);
  map_.Erase(SlotMap::HashOf(s.key), slot);
  s.key = kEmptyKey;
  s.version = -1;
  s.next_use = kNever32;
  s.pin_step = -1;
  s.state = SlotState::kFree;
  s.pinned = false;  // its queue and pin-list entries are stale from here on
  free_.push_back(slot);
}

void CacheMetadata::StartVictims() {
  victims_.clear();
  gather_queue_ = buckets_.Highest(&gather_bucket_);  // lru: the one bucket
  gather_pos_ = gather_queue_ != nullptr ? gather_queue_->head() : 0;
}

void CacheMetadata::GatherVictims(size_t want) {
  const QueuedLive live = queued_live();
  while (victims_.size() < want && gather_queue_ != nullptr) {
    const LazyQueue& q = *gather_queue_;
    const size_t end = q.end();
    for (; gather_pos_ < end && victims_.size() < want; ++gather_pos_) {
      if (gather_pos_ + kApplyAhead < end) live.Prefetch(q.at(gather_pos_ + kApplyAhead));
      const QueueEntry e = q.at(gather_pos_);
      if (!live(e)) continue;
      const SlotRec& s = slots_[e.slot];
      victims_.push_back(
          Victim{e.slot, s.next_use, SlotMap::HashOf(s.key), gather_queue_, gather_pos_});
    }
    if (gather_pos_ >= end) {
      gather_queue_ = buckets_.Below(gather_bucket_, &gather_bucket_);
      gather_pos_ = gather_queue_ != nullptr ? gather_queue_->head() : 0;
    }
  }
}

void CacheMetadata::FinishVictims(size_t consumed) {
  if (consumed > 0) {
    // Victims were consumed in order: every bucket above the last one's is used up.
    const Victim& last = victims_[consumed - 1];
    last.queue->DropBefore(last.pos + 1);
    int32_t key = 0;
    const LazyQueue* top = buckets_.Highest(&key);
    while (top != nullptr && top != last.queue) {
      buckets_.Erase(key);
      top = buckets_.Highest(&key);
    }
  }
  victims_.clear();
  gather_queue_ = nullptr;
}

// ---- batch probing -------------------------------------------------------------------------

template <typename Sink, typename Pre>
void CacheMetadata::Probe(const int64_t* keys, size_t n, Sink&& sink, Pre&& pre) const {
  uint64_t hashes[kRing];
  int32_t cands[kRing];
  const SlotRec* recs = slots_.data();
  const auto hash_stage = [&](size_t i) {
    const uint64_t h = SlotMap::HashOf(keys[i]);
    hashes[i % kRing] = h;
    map_.Prefetch(h);
    pre(h);
  };
  // Absent keys read slot 0's record instead of branching on presence (unpredictable).
  const auto cell_stage = [&](size_t j) {
    const int32_t c = map_.Candidate(hashes[j % kRing]);
    cands[j % kRing] = c;
    __builtin_prefetch(&recs[c < 0 ? 0 : c]);
  };
  const auto record_stage = [&](size_t k) {
    const uint64_t h = hashes[k % kRing];
    int32_t c = cands[k % kRing];
    const int64_t stored = recs[c < 0 ? 0 : c].key;
    // A tag shared with another key (2^-32 per compared cell): probe the whole run.
    if (__builtin_expect((c >= 0) & (stored != keys[k]), 0)) {
      c = map_.Find(keys[k], h, [recs](int32_t slot) { return recs[slot].key; });
    }
    sink(k, c, h);
  };
  // Key i is hashed at iteration i, its cell probed at i + kCellAhead, its record read at
  // i + kCellAhead + kRecordAhead: a ramp-up, the steady state, a drain.
  constexpr size_t kLag = kCellAhead + kRecordAhead;
  const size_t total = n + kLag;
  size_t i = 0;
  for (; i < std::min(total, kLag); ++i) {
    if (i < n) hash_stage(i);
    if (i >= kCellAhead && i - kCellAhead < n) cell_stage(i - kCellAhead);
  }
  for (; i < n; ++i) {
    hash_stage(i);
    cell_stage(i - kCellAhead);
    record_stage(i - kLag);
  }
  for (; i < total; ++i) {
    if (i - kCellAhead < n) cell_stage(i - kCellAhead);
    record_stage(i - kLag);
  }
}

// ---- public operations ---------------------------------------------------------------------

void CacheMetadata::Advance(int64_t step) {
  if (step < step_) {
    throw ValueError("Advance: step " + std::to_string(step) + " is before the current step " +
                     std::to_string(step_));
  }
  CheckStep32(step, "Advance", "step");
  step_ = step;
  step32_ = static_cast<int32_t>(step);
  // Expired pins join the queues in pin order.
  const PinnedLive plive = pinned_live();
  size_t keep = 0;
  for (size_t i = 0; i < pinned_.size(); ++i) {
    if (i + kApplyAhead < pinned_.size()) plive.Prefetch(pinned_[i + kApplyAhead]);
    const QueueEntry e = pinned_[i];
    if (!plive(e)) continue;  // superseded entry
    SlotRec& s = slots_[e.slot];
    if (s.pin_step >= step32_) {
      pinned_[keep++] = e;
      continue;
    }
    s.pinned = false;
    if (s.next_use <= step32_) s.next_use = kNever32;
    Enqueue(e.slot);
  }
  pinned_.resize(keep);
  if (policy_ == EvictionPolicy::kOracle) {
    // Next uses that passed without a read become kNever, oldest bucket first.
    LazyQueue& never = buckets_.Get(kNever32);
    const QueuedLive live = queued_live();
    int32_t bucket = 0;
    while (LazyQueue* q = buckets_.Lowest(&bucket)) {
      if (bucket > step32_) break;
      q->ForEachLive(live, [&](QueueEntry e) {
        SlotRec& s = slots_[e.slot];
        s.next_use = kNever32;
        ++pushes_;
        never.Push(QueueEntry{e.slot, Bump(s)});  // still queued: queued_ unchanged
      });
      buckets_.Erase(bucket);
    }
  }
  // Step-boundary housekeeping: stale queue entries go once they outnumber the live ones.
  if (purge_pending_ || pushes_ > queued_ + kCompactSlack) CompactQueues();
}

QueryResult CacheMetadata::Query(const int64_t* keys, const int64_t* versions,
                                 const int64_t* next_uses, size_t n) {
  QueryResult r;
  r.hit_pos.resize(n);
  r.hit_slots.resize(n);
  r.miss_pos.resize(n);
  const QueryCounts c =
      QueryInto(keys, versions, next_uses, n,
                QueryOut{r.hit_pos.data(), r.hit_slots.data(), r.miss_pos.data()});
  r.hit_pos.resize(static_cast<size_t>(c.hits));
  r.hit_slots.resize(static_cast<size_t>(c.hits));
  r.miss_pos.resize(static_cast<size_t>(c.misses));
  r.stale = c.stale;
  return r;
}

QueryCounts CacheMetadata::QueryInto(const int64_t* keys, const int64_t* versions,
                                     const int64_t* next_uses, size_t n, const QueryOut& out) {
  CheckKeysNonNegative(keys, n, "query");
  CheckNextUses(next_uses, n, "query");
  // Pass 1 (no state change): every key's slot, the positions split into resident ones
  // (hits_) and absent ones (straight into out.miss_pos) without a branch on which.
  found_.resize(n);
  hash_.resize(n);
  hits_.resize(n);
  size_t nh = 0, nm = 0;
  Probe(keys, n, [&](size_t i, int32_t slot, uint64_t h) {
    found_[i] = slot;
    hash_[i] = h;
    hits_[nh] = static_cast<int64_t>(i);
    out.miss_pos[nm] = static_cast<int64_t>(i);
    nh += slot >= 0;
    nm += slot < 0;
  });
  // Duplicates: a resident key by its record's mark, an absent one in the scratch set; the
  // error names the earliest repeat.
  if (++mark_ == 0) {  // wrapped: forget every old mark once
    for (size_t s = 0; s < slots_.size(); ++s) slots_[s].mark = 0;
    mark_ = 1;
  }
  size_t repeat = n;
  for (size_t j = 0; j < nh; ++j) {
    if (j + kApplyAhead < nh) __builtin_prefetch(&slots_[found_[hits_[j + kApplyAhead]]]);
    SlotRec& s = slots_[found_[hits_[j]]];
    if (s.mark == mark_) {
      repeat = static_cast<size_t>(hits_[j]);
      break;
    }
    s.mark = mark_;
  }
  seen_.Reset(nm);
  for (size_t j = 0; j < nm; ++j) {
    if (j + kApplyAhead < nm) seen_.Prefetch(hash_[out.miss_pos[j + kApplyAhead]]);
    const size_t i = static_cast<size_t>(out.miss_pos[j]);
    if (!seen_.Insert(keys[i], hash_[i])) {
      repeat = std::min(repeat, i);
      break;
    }
  }
  if (repeat < n) {
    throw ValueError("query: keys must be unique, key " + std::to_string(keys[repeat]) +
                     " repeats at position " + std::to_string(repeat));
  }
  // Pass 2: resident keys in input order: stale ones are freed (misses), hits touched.
  QueryCounts c;
  stale_.clear();
  for (size_t j = 0; j < nh; ++j) {
    if (j + kApplyAhead < nh) __builtin_prefetch(&slots_[found_[hits_[j + kApplyAhead]]]);
    const size_t i = static_cast<size_t>(hits_[j]);
    const int32_t slot = found_[i];
    if (__builtin_expect(slots_[slot].version != versions[i], 0)) {
      ++stats_.stale;
      FreeSlot(slot);
      stale_.push_back(static_cast<int64_t>(i));
      continue;
    }
    SetNextUse(slot, next_uses[i] < 0 ? kNever32 : static_cast<int32_t>(next_uses[i]));
    out.hit_pos[c.hits] = static_cast<int64_t>(i);
    out.hit_slots[c.hits++] = slot;
  }
  if (!stale_.empty()) {  // merge the stale positions into the (sorted) misses, from the back
    size_t a = nm, b = stale_.size(), w = nm + stale_.size();
    while (b > 0) {
      if (a > 0 && out.miss_pos[a - 1] > stale_[b - 1]) {
        out.miss_pos[--w] = out.miss_pos[--a];
      } else {
        out.miss_pos[--w] = stale_[--b];
      }
    }
  }
  c.stale = static_cast<int64_t>(stale_.size());
  c.misses = static_cast<int64_t>(nm + stale_.size());
  FinishCall();
  return c;
}

PlaceResult CacheMetadata::Admit(const int64_t* keys, const int64_t* versions,
                                 const int64_t* next_uses, size_t n) {
  PlaceResult r;
  r.pos.resize(n);
  r.slots.resize(n);
  r.evicted_keys.resize(n);
  r.bypassed.resize(n);
  const AdmitCounts c = AdmitInto(
      keys, versions, next_uses, n,
      AdmitOut{r.pos.data(), r.slots.data(), r.evicted_keys.data(), r.bypassed.data()});
  r.pos.resize(static_cast<size_t>(c.placed));
  r.slots.resize(static_cast<size_t>(c.placed));
  r.evicted_keys.resize(static_cast<size_t>(c.evicted));
  r.bypassed.resize(static_cast<size_t>(c.bypassed));
  return r;
}

AdmitCounts CacheMetadata::AdmitInto(const int64_t* keys, const int64_t* versions,
                                     const int64_t* next_uses, size_t n, const AdmitOut& out) {
  CheckKeysNonNegative(keys, n, "admit");
  CheckVersions(versions, n, "admit");
  CheckNextUses(next_uses, n, "admit");
  // Pass 1 (no state change): uniqueness, then residency.
  hash_.resize(n);
  seen_.Reset(n);
  size_t repeat = n, resident = n;
  Probe(
      keys, n,
      [&](size_t i, int32_t slot, uint64_t h) {
        hash_[i] = h;
        if (__builtin_expect(!seen_.Insert(keys[i], h), 0)) repeat = std::min(repeat, i);
        if (__builtin_expect(slot >= 0, 0)) resident = std::min(resident, i);
      },
      [&](uint64_t h) { seen_.Prefetch(h); });
  if (repeat < n) {
    throw ValueError("admit: keys must be unique, key " + std::to_string(keys[repeat]) +
                     " repeats at position " + std::to_string(repeat));
  }
  if (resident < n) {
    throw ValueError("admit: key " + std::to_string(keys[resident]) + " is already resident");
  }
  // Pass 2: place in input order: a free slot, else the next victim (Belady with bypass
  // under oracle), evicted and reused in place.
  AdmitCounts c;
  StartVictims();
  size_t next_victim = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i + kApplyAhead < n) map_.Prefetch(hash_[i + kApplyAhead]);
    const int32_t nu = next_uses[i] < 0 ? kNever32 : static_cast<int32_t>(next_uses[i]);
    int32_t slot;
    if (!free_.empty()) {
      if (free_.size() > kApplyAhead) {
        __builtin_prefetch(&slots_[free_[free_.size() - 1 - kApplyAhead]]);
      }
      slot = free_.back();
      free_.pop_back();
    } else {
      if (next_victim + kVictimAhead >= victims_.size()) {
        GatherVictims(next_victim + 4 * kVictimAhead);
      }
      if (next_victim >= victims_.size()) {  // everything resident is pinned
        out.bypassed[c.bypassed++] = static_cast<int64_t>(i);
        continue;
      }
      if (next_victim + kVictimAhead < victims_.size()) {
        const Victim& ahead = victims_[next_victim + kVictimAhead];
        __builtin_prefetch(&slots_[ahead.slot]);
        map_.Prefetch(ahead.hash);
      }
      const Victim& v = victims_[next_victim];
      // Belady with bypass; among rows with no known next use (both kNever) fall back to
      // LRU, so a short window never freezes the cache against new rows.
      if (policy_ == EvictionPolicy::kOracle &&
          (v.next_use < nu || (v.next_use == nu && nu != kNever32))) {
        out.bypassed[c.bypassed++] = static_cast<int64_t>(i);
        continue;
      }
      ++next_victim;
      slot = v.slot;
      SlotRec& s = slots_[slot];  // queued, hence unpinned
      out.evicted_keys[c.evicted++] = s.key;
      Unqueue(s);
      map_.Erase(v.hash, slot);
    }
    SlotRec& s = slots_[slot];
    s.key = keys[i];
    s.version = static_cast<int32_t>(versions[i]);
    s.next_use = nu;
    s.state = SlotState::kReady;
    s.pin_step = step32_;
    s.pinned = true;
    pinned_.push_back(QueueEntry{slot, Bump(s)});
    map_.Insert(hash_[i], slot);
    out.pos[c.placed] = static_cast<int64_t>(i);
    out.slots[c.placed++] = slot;
  }
  FinishVictims(next_victim);
  stats_.admitted += c.placed;
  stats_.evictions += c.evicted;
  stats_.bypassed += c.bypassed;
  FinishCall();
  return c;
}

void CacheMetadata::Lookup(const int64_t* keys, size_t n, int64_t* out_slots) const {
  Probe(keys, n, [&](size_t i, int32_t slot, uint64_t) { out_slots[i] = slot; });
}

void CacheMetadata::Resident(const int64_t* keys, const int64_t* versions, size_t n,
                             int64_t* out_slots) const {
  Probe(keys, n, [&](size_t i, int32_t slot, uint64_t) {
    out_slots[i] = slot >= 0 && slots_[slot].version == versions[i] ? slot : -1;
  });
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
  const int32_t use = static_cast<int32_t>(step);
  found_.resize(n);
  Probe(keys, n, [&](size_t i, int32_t slot, uint64_t) { found_[i] = slot; });
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
  found_.resize(n);
  Probe(keys, n, [&](size_t i, int32_t slot, uint64_t) { found_[i] = slot; });
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
  st.resident = static_cast<int64_t>(map_.size());
  st.pinned = 0;
  const PinnedLive plive = pinned_live();
  for (const QueueEntry& e : pinned_) {
    if (plive(e) && IsPinned(slots_[e.slot])) ++st.pinned;
  }
  st.memory_bytes = static_cast<int64_t>(
      slots_.memory_bytes() + map_.memory_bytes() + free_.capacity() * sizeof(int32_t) +
      buckets_.memory_bytes() + pinned_.capacity() * sizeof(QueueEntry) + seen_.memory_bytes() +
      found_.capacity() * sizeof(int32_t) + hash_.capacity() * sizeof(uint64_t) +
      (hits_.capacity() + stale_.capacity()) * sizeof(int64_t) +
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
