// CacheMetadata::Admit: the second batch call of a step (slots for the misses).
//
// Validation first (key range, versions, next uses, uniqueness, then residency in a
// pipelined probe; nothing changes, so a throwing call changed nothing), then placement in
// input order: a free slot, else the next victim of the stream Admit's queues give
// (cache_metadata_queues.cc), evicted and reused in place; under oracle a candidate whose
// next use is not sooner than the victim's is bypassed (invariant 5). One template per index
// (direct or hash), chosen once per call.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "cache/cache_metadata.h"
#include "cache/cache_metadata_checks.h"
#include "cache/cache_metadata_probe.h"
#include "common/errors.h"

namespace bagpipe::cache {

using namespace metadata_detail;

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
  CheckKeys(keys, n, "admit");
  metadata_checks::CheckVersions(versions, n, "admit");
  metadata_checks::CheckNextUses(next_uses, n, "admit");
  return WithIndex([&](auto& index) { return AdmitWith(index, keys, versions, next_uses, n, out); });
}

template <typename Index>
void CacheMetadata::ValidateAdmitKeys(const Index& index, const int64_t* keys, size_t n) {
  metadata_checks::CheckRepeat(keys, MarkUnique(index, keys, n), n, "admit");
  size_t resident = n;
  Probe(index, keys, n, [&](size_t i, int32_t slot, uint64_t) {
    if (__builtin_expect(slot >= 0, 0)) resident = std::min(resident, i);
  });
  if (resident < n) {
    UnmarkAll(index, keys, n);
    throw ValueError("admit: key " + std::to_string(keys[resident]) + " is already resident");
  }
}

// The direct index validates in one pass over the keys' own cells: each absent key's cell is
// claimed, so a repeat or a resident key finds a non-empty cell. On a failure the claims are
// undone and the two-pass validation names the error as the hash path would.
bool CacheMetadata::ClaimAdmitKeys(DirectIndex& index, const int64_t* keys, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (i + kApplyAhead < n) index.Prefetch(DirectIndex::HashOf(keys[i + kApplyAhead]));
    const uint64_t h = DirectIndex::HashOf(keys[i]);
    if (__builtin_expect(!index.Absent(h), 0)) {
      for (size_t j = 0; j < i; ++j) index.Unclaim(DirectIndex::HashOf(keys[j]));
      return false;
    }
    index.Claim(h);
  }
  return true;
}

template <typename Index>
AdmitCounts CacheMetadata::AdmitWith(Index& index, const int64_t* keys, const int64_t* versions,
                                     const int64_t* next_uses, size_t n, const AdmitOut& out) {
  if constexpr (Index::kExact) {
    if (!ClaimAdmitKeys(index, keys, n)) {
      ValidateAdmitKeys(index, keys, n);  // throws
      UnmarkAll(index, keys, n);
      throw std::logic_error("admit: a claim failed but the keys validate");
    }
  } else {
    ValidateAdmitKeys(index, keys, n);
  }
  // The key's index hash: the hash path kept it from MarkUnique, the direct one is the key.
  const auto hash_of = [&](size_t i) -> uint64_t {
    if constexpr (Index::kExact) {
      return Index::HashOf(keys[i]);
    } else {
      return hash_[i];
    }
  };
  // Placement in input order (nothing throws from here on).
  AdmitCounts c;
  StartVictims();
  size_t next_victim = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i + kApplyAhead < n) index.Prefetch(hash_of(i + kApplyAhead));
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
        if constexpr (Index::kExact) index.Unclaim(hash_of(i));
        out.bypassed[c.bypassed++] = static_cast<int64_t>(i);
        continue;
      }
      if (next_victim + kVictimAhead < victims_.size()) {
        const Victim& ahead = victims_[next_victim + kVictimAhead];
        __builtin_prefetch(&slots_[ahead.slot]);
        index.Prefetch(ahead.hash);
      }
      const Victim& v = victims_[next_victim];
      // Belady with bypass; among rows with no known next use (both kNever) fall back to
      // LRU, so a short window never freezes the cache against new rows.
      if (policy_ == EvictionPolicy::kOracle &&
          (v.next_use < nu || (v.next_use == nu && nu != kNever32))) {
        if constexpr (Index::kExact) index.Unclaim(hash_of(i));
        out.bypassed[c.bypassed++] = static_cast<int64_t>(i);
        continue;
      }
      ++next_victim;
      slot = v.slot;
      SlotRec& s = slots_[slot];  // queued, hence unpinned
      out.evicted_keys[c.evicted++] = s.key;
      Unqueue(s);
      index.Erase(v.hash, slot);
    }
    SlotRec& s = slots_[slot];
    s.key = keys[i];
    s.version = static_cast<int32_t>(versions[i]);
    s.next_use = nu;
    s.state = SlotState::kReady;
    s.pin_step = step32_;
    s.pinned = true;
    pinned_.push_back(QueueEntry{slot, Bump(s)});
    index.Insert(hash_of(i), slot);
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

}  // namespace bagpipe::cache
