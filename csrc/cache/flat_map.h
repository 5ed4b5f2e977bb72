// Open-addressing hash maps from non-negative int64 keys to small trivially-copyable values,
// the building block of the cache metadata and the planners.
//
// Thread safety: none; each map is owned by one object that serializes access.
//
// Invariants:
//   1. Capacity is a power of two and the load factor stays <= 1/2 (Grow doubles it).
//   2. kEmptyKey (-1) marks an empty cell; stored keys are >= 0 (callers validate this).
//   3. Linear probing; FlatMap::Erase uses backward-shift deletion, so a lookup never needs
//      tombstones and probe sequences stay as short as at insertion.
//   4. StampedMap::Clear is O(1): a cell is live only when its stamp equals the map's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace bagpipe::cache {

inline constexpr int64_t kEmptyKey = -1;

// splitmix64's finalizer: a fast bijective mixer that spreads sequential keys.
inline uint64_t MixKey(int64_t key) {
  uint64_t z = static_cast<uint64_t>(key) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The smallest power of two >= max(n, 16).
inline size_t RoundUpPow2(size_t n) {
  size_t c = 16;
  while (c < n) c <<= 1;
  return c;
}

template <typename V>
class FlatMap {
 public:
  struct Cell {
    int64_t key;
    V value;
  };

  // Empty, with room for `expected` keys before the first rehash.
  explicit FlatMap(size_t expected = 0) { Rehash(RoundUpPow2(expected * 2 + 2)); }

  // Keys stored, cells allocated (a power of two), and the cells' bytes.
  size_t size() const { return size_; }
  size_t capacity() const { return cells_.size(); }
  size_t memory_bytes() const { return cells_.size() * sizeof(Cell); }

  // Hints the cache that `key` will be probed soon.
  void Prefetch(int64_t key) const {
    __builtin_prefetch(&cells_[MixKey(key) & mask_]);
  }

  // Room for `n` more keys without a rehash (so prefetched cells stay where they are).
  void Reserve(size_t n) {
    if ((size_ + n) * 2 > cells_.size()) Rehash(RoundUpPow2((size_ + n) * 2));
  }

  // Returns the value of `key`, or nullptr.  The pointer is valid until the next insert/erase.
  V* Find(int64_t key) {
    size_t i = MixKey(key) & mask_;
    while (true) {
      Cell& c = cells_[i];
      if (c.key == key) return &c.value;
      if (c.key == kEmptyKey) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  // As Find, read-only.
  const V* Find(int64_t key) const { return const_cast<FlatMap*>(this)->Find(key); }

  // Returns (value pointer, inserted).  A new cell's value is `init`.
  // REQUIRES: key >= 0.
  std::pair<V*, bool> FindOrInsert(int64_t key, const V& init) {
    if ((size_ + 1) * 2 > cells_.size()) Rehash(cells_.size() * 2);
    size_t i = MixKey(key) & mask_;
    while (true) {
      Cell& c = cells_[i];
      if (c.key == key) return {&c.value, false};
      if (c.key == kEmptyKey) {
        c.key = key;
        c.value = init;
        ++size_;
        return {&c.value, true};
      }
      i = (i + 1) & mask_;
    }
  }

  // Removes `key`; returns whether it was present.
  bool Erase(int64_t key) {
    size_t i = MixKey(key) & mask_;
    while (true) {
      if (cells_[i].key == key) break;
      if (cells_[i].key == kEmptyKey) return false;
      i = (i + 1) & mask_;
    }
    // Backward-shift: pull later cells of the probe run into the hole when their home
    // position does not lie cyclically in (hole, j].
    size_t hole = i;
    size_t j = i;
    while (true) {
      j = (j + 1) & mask_;
      if (cells_[j].key == kEmptyKey) break;
      size_t home = MixKey(cells_[j].key) & mask_;
      bool in_range = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!in_range) {
        cells_[hole] = cells_[j];
        hole = j;
      }
    }
    cells_[hole].key = kEmptyKey;
    --size_;
    return true;
  }

  // Removes every key; the capacity stays.
  void Clear() {
    for (auto& c : cells_) c.key = kEmptyKey;
    size_ = 0;
  }

 private:
  void Rehash(size_t new_capacity) {
    std::vector<Cell> old;
    old.swap(cells_);
    cells_.assign(new_capacity, Cell{kEmptyKey, V{}});
    mask_ = new_capacity - 1;
    size_ = 0;
    for (const auto& c : old) {
      if (c.key == kEmptyKey) continue;
      size_t i = MixKey(c.key) & mask_;
      while (cells_[i].key != kEmptyKey) i = (i + 1) & mask_;
      cells_[i] = c;
      ++size_;
    }
  }

  std::vector<Cell> cells_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// An insert-only map that is cleared in O(1) between uses (one per planned step).
template <typename V>
class StampedMap {
 public:
  struct Cell {
    int64_t key;
    uint32_t stamp;
    V value;
  };

  // Empties the map and makes room for `n` keys without rehashing.
  void Reset(size_t n) {
    size_t want = RoundUpPow2(n * 2 + 2);
    if (want > cells_.size()) {
      cells_.assign(want, Cell{kEmptyKey, 0, V{}});
      mask_ = want - 1;
      stamp_ = 0;
    }
    if (++stamp_ == 0) {  // wrapped: forget every old stamp once
      for (auto& c : cells_) c.stamp = 0;
      stamp_ = 1;
    }
    size_ = 0;
  }

  // Keys inserted since the last Reset, and the cells' bytes.
  size_t size() const { return size_; }
  size_t memory_bytes() const { return cells_.size() * sizeof(Cell); }

  // Hints the cache that `key` will be probed soon.
  void Prefetch(int64_t key) const { __builtin_prefetch(&cells_[MixKey(key) & mask_]); }

  // REQUIRES: Reset(n) was called with n >= the number of distinct keys inserted since.
  std::pair<V*, bool> FindOrInsert(int64_t key, const V& init) {
    size_t i = MixKey(key) & mask_;
    while (true) {
      Cell& c = cells_[i];
      if (c.stamp != stamp_) {
        c.key = key;
        c.stamp = stamp_;
        c.value = init;
        ++size_;
        return {&c.value, true};
      }
      if (c.key == key) return {&c.value, false};
      i = (i + 1) & mask_;
    }
  }

  // The value of `key` inserted since the last Reset, or nullptr.
  V* Find(int64_t key) {
    size_t i = MixKey(key) & mask_;
    while (true) {
      Cell& c = cells_[i];
      if (c.stamp != stamp_) return nullptr;
      if (c.key == key) return &c.value;
      i = (i + 1) & mask_;
    }
  }

 private:
  std::vector<Cell> cells_;
  size_t mask_ = 0;
  size_t size_ = 0;
  uint32_t stamp_ = 0;
};

}  // namespace bagpipe::cache
