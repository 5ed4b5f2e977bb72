// EvictionBuckets: the cache metadata's eviction queues, one LazyQueue per bucket key (oracle:
// the next use of the rows in it; lru: one bucket, key 0), ordered by key.
//
// The buckets live in a std::map (ordered, stable addresses); a 64-entry direct-mapped cache
// in front of it finds a bucket in O(1) on the hot paths, where the keys in use are the few
// steps of the lookahead window. Erased buckets give their buffers to a small spare list, so
// the bucket of each new step reuses the memory of a drained one.
//
// Thread safety: none; the owner serializes access.
//
// Invariants:
//   1. Every cached pointer refers to a bucket present in the map under the cached key.
//   2. Buckets are only created by Get and only removed by Erase/Clear, which keep 1.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <vector>

#include "cache/lazy_queue.h"

namespace bagpipe::cache {

class EvictionBuckets {
 public:
  // Starts with no bucket.
  EvictionBuckets() { ForgetCache(); }

  // The bucket of `key`, created empty when absent.
  LazyQueue& Get(int32_t key) {
    Cached& c = cache_[static_cast<uint32_t>(key) & (kCache - 1)];
    if (c.queue != nullptr && c.key == key) return *c.queue;
    auto it = map_.find(key);
    if (it == map_.end()) {
      if (spare_.empty()) {
        it = map_.emplace(key, LazyQueue()).first;
      } else {
        it = map_.emplace(key, LazyQueue(std::move(spare_.back()))).first;
        spare_.pop_back();
      }
    }
    c = Cached{key, &it->second};
    return it->second;
  }

  // No bucket exists (empty buckets count as buckets until erased).
  bool empty() const { return map_.empty(); }

  // The highest- / lowest-keyed bucket (live entries or not), or nullptr when none.
  LazyQueue* Highest(int32_t* key) {
    if (map_.empty()) return nullptr;
    auto it = std::prev(map_.end());
    *key = it->first;
    return &it->second;
  }
  // The bucket just below `key`, or nullptr.
  LazyQueue* Below(int32_t key, int32_t* below) {
    auto it = map_.lower_bound(key);
    if (it == map_.begin()) return nullptr;
    --it;
    *below = it->first;
    return &it->second;
  }
  // Erases every bucket keyed above `key`.
  void EraseAbove(int32_t key) {
    while (!map_.empty() && std::prev(map_.end())->first > key) {
      Erase(std::prev(map_.end())->first);
    }
  }
  // The lowest-keyed bucket (live entries or not), or nullptr when none.
  LazyQueue* Lowest(int32_t* key) {
    if (map_.empty()) return nullptr;
    *key = map_.begin()->first;
    return &map_.begin()->second;
  }

  // Drops the bucket of `key` (its storage kept for reuse); no-op when absent.
  void Erase(int32_t key) {
    auto it = map_.find(key);
    if (it == map_.end()) return;
    Cached& c = cache_[static_cast<uint32_t>(key) & (kCache - 1)];
    if (c.queue == &it->second) c = Cached{0, nullptr};
    if (spare_.size() < kSpares) spare_.push_back(it->second.Release());
    map_.erase(it);
  }

  // fn(key, queue) for every bucket, ascending (descending = false) or descending keys.
  template <typename Fn>
  void ForEach(bool descending, Fn&& fn) const {
    if (descending) {
      for (auto it = map_.rbegin(); it != map_.rend(); ++it) fn(it->first, it->second);
    } else {
      for (const auto& [k, q] : map_) fn(k, q);
    }
  }
  // fn(key, queue) for every bucket, ascending keys; fn may change the queues, not the set.
  template <typename Fn>
  void ForEachMutable(Fn&& fn) {
    for (auto& [k, q] : map_) fn(k, q);
  }

  // Bytes held by the buckets and their spare storage (an estimate of the map's nodes).
  size_t memory_bytes() const {
    size_t b = 0;
    for (const auto& [k, q] : map_) b += q.memory_bytes() + sizeof(q) + 4 * sizeof(void*);
    for (const auto& v : spare_) b += v.capacity() * sizeof(QueueEntry);
    return b;
  }

  // Drops every bucket and the spare storage.
  void Clear() {
    map_.clear();
    spare_.clear();
    ForgetCache();
  }

 private:
  static constexpr size_t kCache = 64;
  static constexpr size_t kSpares = 4;
  struct Cached {
    int32_t key;
    LazyQueue* queue;
  };

  void ForgetCache() { cache_.fill(Cached{0, nullptr}); }

  std::map<int32_t, LazyQueue> map_;
  std::array<Cached, kCache> cache_;
  std::vector<std::vector<QueueEntry>> spare_;
};

}  // namespace bagpipe::cache
