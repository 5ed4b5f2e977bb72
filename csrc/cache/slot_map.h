// SlotMap: the cache metadata's key -> slot index. An open-addressing table of 8-byte cells
// {32-bit hash tag, slot + 1}; the keys themselves live in the slot table, so a cell is a
// quarter of a {key, slot} pair's cache footprint and a probe reads one cache line.
//
// A key's 64-bit hash h = MixKey(key) gives its tag (the high 32 bits) and its home cell (the
// tag's top log2(cells) bits), so Erase's backward shift finds every cell's home from the
// cell alone. Equal tags of different keys (probability 2^-32 per compared cell) are told
// apart by the caller's key_of(slot).
//
// Thread safety: none; the owner serializes access.
//
// Invariants:
//   1. cells is a power of two >= 2 * max_entries (load <= 1/2); a cell is 0 when empty.
//   2. Linear probing; Erase uses backward-shift deletion (no tombstones), so every stored
//      key sits in the probe run from its home without an empty cell in between.
//   3. One cell per stored slot; the caller inserts only absent keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cache/flat_map.h"
#include "cache/huge_array.h"

namespace bagpipe::cache {

class SlotMap {
 public:
  SlotMap() = default;
  // REQUIRES: 1 <= max_entries <= 2^31.
  explicit SlotMap(size_t max_entries) {
    size_t cells = 16;
    int bits = 4;
    while (cells < 2 * max_entries) {
      cells <<= 1;
      ++bits;
    }
    cells_ = HugeArray<uint64_t>(cells);
    mask_ = cells - 1;
    shift_ = 32 - bits;
  }

  static uint64_t HashOf(int64_t key) { return MixKey(key); }

  size_t size() const { return size_; }
  size_t memory_bytes() const { return cells_.memory_bytes(); }

  void Prefetch(uint64_t h) const { __builtin_prefetch(&cells_[Home(Tag(h))]); }

  // The slot of the first cell from the key's home whose tag matches h, or -1 at an empty
  // cell: the key's slot unless another key has the same tag (the caller checks key_of).
  int32_t Candidate(uint64_t h) const {
    const uint32_t tag = Tag(h);
    for (size_t i = Home(tag);; i = (i + 1) & mask_) {
      const uint64_t c = cells_[i];
      if (c == 0) return -1;
      if (static_cast<uint32_t>(c >> 32) == tag) return SlotOf(c);
    }
  }

  // The slot of `key` (hash h), or -1. key_of(slot) returns the key stored in a slot.
  template <typename KeyOf>
  int32_t Find(int64_t key, uint64_t h, const KeyOf& key_of) const {
    const uint32_t tag = Tag(h);
    for (size_t i = Home(tag);; i = (i + 1) & mask_) {
      const uint64_t c = cells_[i];
      if (c == 0) return -1;
      if (static_cast<uint32_t>(c >> 32) == tag && key_of(SlotOf(c)) == key) return SlotOf(c);
    }
  }

  // REQUIRES: the key (hash h) is absent and size() < the constructor's max_entries.
  void Insert(uint64_t h, int32_t slot) {
    const uint32_t tag = Tag(h);
    size_t i = Home(tag);
    while (cells_[i] != 0) i = (i + 1) & mask_;
    cells_[i] = (static_cast<uint64_t>(tag) << 32) | (static_cast<uint32_t>(slot) + 1u);
    ++size_;
  }

  // Removes the cell of `slot`, whose key has hash h. REQUIRES: it is present.
  void Erase(uint64_t h, int32_t slot) {
    const uint64_t want = (static_cast<uint64_t>(Tag(h)) << 32) | (static_cast<uint32_t>(slot) + 1u);
    size_t hole = Home(Tag(h));
    while (cells_[hole] != want) hole = (hole + 1) & mask_;
    // Backward shift: pull later cells of the run into the hole unless their home lies
    // cyclically in (hole, j].
    for (size_t j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
      const uint64_t c = cells_[j];
      if (c == 0) break;
      const size_t home = Home(static_cast<uint32_t>(c >> 32));
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!stays) {
        cells_[hole] = c;
        hole = j;
      }
    }
    cells_[hole] = 0;
    --size_;
  }

  void Clear() {
    std::memset(cells_.data(), 0, cells_.size() * sizeof(uint64_t));
    size_ = 0;
  }

 private:
  static uint32_t Tag(uint64_t h) { return static_cast<uint32_t>(h >> 32); }
  size_t Home(uint32_t tag) const { return shift_ >= 32 ? 0 : (tag >> shift_) & mask_; }
  static int32_t SlotOf(uint64_t c) { return static_cast<int32_t>(static_cast<uint32_t>(c) - 1u); }

  HugeArray<uint64_t> cells_;
  size_t mask_ = 0;
  int shift_ = 32;
  size_t size_ = 0;
};

}  // namespace bagpipe::cache
