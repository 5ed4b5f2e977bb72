// CacheMetadata::Query: the first batch call of a step (hits, stale rows and misses).
//
// Two passes: validation (key range, next uses, uniqueness; nothing changes, so a throwing
// call changed nothing), then one pipelined probe (cache_metadata_probe.h) that acts on each
// key in input order: a miss is written out, a stale slot freed and written out as a miss,
// a hit touched (its next use set, most recent in its bucket) and written out. One template
// per index (direct or hash), chosen once per call.
#include <string>

#include "cache/cache_metadata.h"
#include "cache/cache_metadata_checks.h"
#include "cache/cache_metadata_probe.h"

namespace bagpipe::cache {

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
  CheckKeys(keys, n, "query");
  metadata_checks::CheckNextUses(next_uses, n, "query");
  return WithIndex([&](auto& index) { return QueryWith(index, keys, versions, next_uses, n, out); });
}

template <typename Index>
QueryCounts CacheMetadata::QueryWith(Index& index, const int64_t* keys, const int64_t* versions,
                                     const int64_t* next_uses, size_t n, const QueryOut& out) {
  metadata_checks::CheckRepeat(keys, MarkUnique(index, keys, n), n, "query");
  // From here on nothing throws: every key is acted on, in input order.
  QueryCounts c;
  size_t nm = 0;
  Probe(index, keys, n, [&](size_t i, int32_t slot, uint64_t) {
    if (slot < 0) {
      out.miss_pos[nm++] = static_cast<int64_t>(i);
      return;
    }
    if (__builtin_expect(slots_[slot].version != versions[i], 0)) {
      ++c.stale;
      ++stats_.stale;
      FreeSlot(slot);
      out.miss_pos[nm++] = static_cast<int64_t>(i);
      return;
    }
    SetNextUse(slot, next_uses[i] < 0 ? kNever32 : static_cast<int32_t>(next_uses[i]));
    out.hit_pos[c.hits] = static_cast<int64_t>(i);
    out.hit_slots[c.hits++] = slot;
  });
  UnmarkAll(index, keys, n);
  c.misses = static_cast<int64_t>(nm);
  FinishCall();
  return c;
}

}  // namespace bagpipe::cache
