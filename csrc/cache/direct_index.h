// DirectIndex and KeyBits: the cache metadata's key -> slot index and uniqueness scratch for
// a table whose keys are known to lie in [0, key_bound) with key_bound small enough to give
// every key its own cell (cache_metadata.h says when). A lookup is one array read at the key
// itself: no hash, no probe run, no tag to verify, and absent keys cost the same as present
// ones, where SlotMap (slot_map.h) spends a hash, a window scan and a tag check per key.
//
// DirectIndex has SlotMap's interface (HashOf, Prefetch, Candidate, Find, Insert, Erase,
// Clear), with "hash" = the key itself, so the metadata's batch loops are one template over
// both (cache_metadata_probe.h); kExact tells them a candidate needs no key check.
//
// Thread safety: none; the owner serializes access.
//
// Invariants:
//   1. DirectIndex: cell k holds slot + 1 of key k, 0 when absent (a fresh mapping is all
//      absent, and untouched pages cost no memory); size() counts the non-zero cells.
//   2. KeyBits: bit k is set exactly while key k is marked; a call that marks keys clears
//      them before it returns or throws, so every call starts with all bits clear.
//   3. Every key handed to either is in [0, key_bound) (the callers validate first).
//   4. Outside an Admit call no DirectIndex cell holds kClaimed (every cell is 0 or slot + 1).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cache/huge_array.h"

namespace bagpipe::cache {

class DirectIndex {
 public:
  static constexpr bool kExact = true;  // Candidate is the answer (no key check)

  DirectIndex() = default;
  // REQUIRES: 1 <= key_bound (CacheMetadata::UsesDirectIndex bounds it: <= 2^24 or
  // <= 32 per cache slot).
  explicit DirectIndex(int64_t key_bound)
      : cells_(static_cast<size_t>(key_bound)), bound_(key_bound) {}

  // The "hash" every other call takes: the key itself.
  static uint64_t HashOf(int64_t key) { return static_cast<uint64_t>(key); }

  int64_t key_bound() const { return bound_; }
  size_t size() const { return size_; }
  size_t memory_bytes() const { return cells_.memory_bytes(); }

  // Hints the cache that key h will be looked up (or written) soon.
  void Prefetch(uint64_t h) const { __builtin_prefetch(&cells_[h]); }

  // The slot of key h, or -1.
  int32_t Candidate(uint64_t h) const { return static_cast<int32_t>(cells_[h] - 1u); }
  template <typename KeyOf>
  int32_t Find(int64_t /*key*/, uint64_t h, const KeyOf& /*key_of*/) const {
    return Candidate(h);
  }

  // REQUIRES: key h absent.
  void Insert(uint64_t h, int32_t slot) {
    cells_[h] = static_cast<uint32_t>(slot) + 1u;
    ++size_;
  }
  // REQUIRES: key h present (at `slot`).
  void Erase(uint64_t h, int32_t /*slot*/) {
    cells_[h] = 0;
    --size_;
  }

  // Claims: inside one Admit call an absent key's cell is marked claimed (kClaimed, not a
  // slot) until the call places it (Insert) or gives it up (Unclaim); a second claim of the
  // same key, or a claim of a present one, is seen by Absent. No cell stays claimed after
  // the call returns or throws (invariant 4).
  static constexpr uint32_t kClaimed = 0xFFFFFFFFu;
  bool Absent(uint64_t h) const { return cells_[h] == 0; }
  void Claim(uint64_t h) { cells_[h] = kClaimed; }
  void Unclaim(uint64_t h) { cells_[h] = 0; }

  // Removes every key.
  void Clear() {
    if (size_ > 0) std::memset(cells_.data(), 0, cells_.size() * sizeof(uint32_t));
    size_ = 0;
  }

 private:
  HugeArray<uint32_t> cells_;
  int64_t bound_ = 0;
  size_t size_ = 0;
};

class KeyBits {
  // ClearAll clears every word once n keys reach words / kWordsPerKeyClear.
  static constexpr size_t kWordsPerKeyClear = 16;

 public:
  KeyBits() = default;
  // All clear, for keys in [0, key_bound).
  explicit KeyBits(int64_t key_bound) : words_(static_cast<size_t>((key_bound + 63) / 64)) {}

  size_t memory_bytes() const { return words_.memory_bytes(); }

  void Prefetch(int64_t key) const { __builtin_prefetch(&words_[static_cast<size_t>(key) >> 6]); }

  // Marks `key`; false when it was marked already.
  bool TestAndSet(int64_t key) {
    uint64_t& w = words_[static_cast<size_t>(key) >> 6];
    const uint64_t bit = uint64_t{1} << (key & 63);
    const bool was = (w & bit) != 0;
    w |= bit;
    return !was;
  }
  // Unmarks `key`.
  void Clear(int64_t key) { words_[static_cast<size_t>(key) >> 6] &= ~(uint64_t{1} << (key & 63)); }
  // Unmarks keys[0, n) (REQUIRES: no other key is marked): key by key when they are few,
  // else one sequential clear of every word, which costs less than random read-modify-writes
  // of most words (and keeps them out of the way of the index's random reads).
  void ClearAll(const int64_t* keys, size_t n) {
    if (n * kWordsPerKeyClear >= words_.size()) {
      if (words_.size() > 0) std::memset(words_.data(), 0, words_.size() * sizeof(uint64_t));
      return;
    }
    for (size_t i = 0; i < n; ++i) Clear(keys[i]);
  }

  // Marks keys[0, n) and returns n, or, at the first key marked already (the earliest
  // repeat), unmarks what it marked and returns that position: all bits clear again.
  size_t MarkUnique(const int64_t* keys, size_t n) {
    constexpr size_t kAhead = 16;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) Prefetch(keys[i + kAhead]);
      if (!TestAndSet(keys[i])) {
        ClearAll(keys, i);
        return i;
      }
    }
    return n;
  }

 private:
  HugeArray<uint64_t> words_;
};

}  // namespace bagpipe::cache
