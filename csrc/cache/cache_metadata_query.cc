// CacheMetadata::Query: the first batch call of a step (hits, stale rows and misses).
//
// Two passes: validation (key range, next uses, uniqueness; nothing changes, so a throwing
// call changed nothing), then one pipelined probe (cache_metadata_probe.h) that acts on each
// key in input order: a miss is written out, a stale slot freed and written out as a miss,
// a hit touched (its next use set, most recent in its bucket: one append to that bucket,
// inlined, with no lookup when it is the previous hit's bucket) and written out. One template
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
  // A hit re-queues its slot at the tail of its next use's bucket (SetNextUse, inlined): the
  // bucket of the previous hit is remembered, since most hits of a step share a few buckets
  // (no bucket is created or erased by another path during the probe: the pointer stays
  // valid, EvictionBuckets keeps stable addresses).
  int32_t last_bucket = 0;
  LazyQueue* last_queue = nullptr;
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
    SlotRec& s = slots_[slot];
    const int32_t nu = next_uses[i] < 0 ? kNever32 : static_cast<int32_t>(next_uses[i]);
    s.next_use = nu;
    if (s.queued) {  // still queued: queued_ is unchanged, the old entry goes stale
      const int32_t bucket = BucketOf(nu);
      if (last_queue == nullptr || bucket != last_bucket) {
        last_queue = &buckets_.Get(bucket);
        last_bucket = bucket;
      }
      ++pushes_;
      last_queue->Push(QueueEntry{slot, Bump(s)});
    }
    out.hit_pos[c.hits] = static_cast<int64_t>(i);
    out.hit_slots[c.hits++] = slot;
  });
  UnmarkAll(index, keys, n);
  c.misses = static_cast<int64_t>(nm);
  FinishCall();
  return c;
}

}  // namespace bagpipe::cache
