// The cache metadata's software-pipelined index probe (CacheMetadata::Probe) and the prefetch
// distances its batch loops share. Internal to the cache_metadata*.cc files.
//
// A key is hashed and its index cell prefetched kCellAhead keys before its cell is read (and
// its slot record prefetched), which happens kRecordAhead keys before the record is used:
// the distances cover a DRAM access at a few ns of work per key. With the hash index a
// candidate slot is verified against the record's key (a shared 32-bit tag, 2^-32 per
// compared cell, falls back to the full probe); the direct index's candidate is exact.
//
// Thread safety: as CacheMetadata (none; the owner serializes calls).
//
// Invariants:
//   1. sink(i, ...) runs once per key, in input order, after every sink(j < i).
//   2. pre(i, h) runs for key i before sink(i, ...), kCellAhead + kRecordAhead keys ahead.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cache/cache_metadata.h"

namespace bagpipe::cache {

namespace metadata_detail {
constexpr size_t kCellAhead = 16;
constexpr size_t kRecordAhead = 16;
constexpr size_t kRing = 64;         // > kCellAhead + kRecordAhead, a power of two
constexpr size_t kApplyAhead = 16;   // record prefetch distance of the mutating passes
constexpr size_t kVictimAhead = 16;  // victims gathered / prefetched ahead of their eviction
// Queue entries pushed beyond the live ones before the queues are compacted.
constexpr int64_t kCompactSlack = 4096;
}  // namespace metadata_detail

template <typename Index, typename Sink, typename Pre>
void CacheMetadata::Probe(const Index& index, const int64_t* keys, size_t n, Sink&& sink,
                          Pre&& pre) const {
  using namespace metadata_detail;
  uint64_t hashes[kRing];
  int32_t cands[kRing];
  const SlotRec* recs = slots_.data();
  const auto hash_stage = [&](size_t i) {
    const uint64_t h = Index::HashOf(keys[i]);
    hashes[i % kRing] = h;
    index.Prefetch(h);
    pre(i, h);
  };
  // Absent keys read slot 0's record instead of branching on presence (unpredictable).
  const auto cell_stage = [&](size_t j) {
    const int32_t c = index.Candidate(hashes[j % kRing]);
    cands[j % kRing] = c;
    __builtin_prefetch(&recs[c < 0 ? 0 : c]);
  };
  const auto record_stage = [&](size_t k) {
    const uint64_t h = hashes[k % kRing];
    int32_t c = cands[k % kRing];
    if constexpr (!Index::kExact) {
      const int64_t stored = recs[c < 0 ? 0 : c].key;
      if (__builtin_expect((c >= 0) & (stored != keys[k]), 0)) {
        c = index.Find(keys[k], h, [recs](int32_t slot) { return recs[slot].key; });
      }
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

inline size_t CacheMetadata::MarkUnique(const SlotMap&, const int64_t* keys, size_t n) {
  using metadata_detail::kApplyAhead;
  hash_.resize(n);
  for (size_t i = 0; i < n; ++i) hash_[i] = SlotMap::HashOf(keys[i]);
  seen_.Reset(n);
  for (size_t i = 0; i < n; ++i) {
    if (i + kApplyAhead < n) seen_.Prefetch(hash_[i + kApplyAhead]);
    if (!seen_.Insert(keys[i], hash_[i])) return i;
  }
  return n;
}

inline size_t CacheMetadata::MarkUnique(const DirectIndex&, const int64_t* keys, size_t n) {
  return bits_.MarkUnique(keys, n);
}

}  // namespace bagpipe::cache
