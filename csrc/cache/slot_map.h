// SlotMap: the cache metadata's key -> slot index. An open-addressing table of 8-byte cells
// {32-bit hash tag, slot + 1}; the keys themselves live in the slot table, so a cell is half
// of a {key, slot} pair's footprint and the cells a probe needs share one cache line.
//
// A key's 64-bit hash h = MixKey(key) gives its tag (the high 32 bits) and its home cell (the
// tag's top log2(cells) bits), so Erase's backward shift finds every cell's home from the
// cell alone. Equal tags of different keys (probability 2^-32 per compared cell) are told
// apart by the caller's key_of(slot).
//
// Probes look at the kWindow cells from the home at once (match and empty bit masks,
// window_masks.h, no branch per cell): whether a key is present is data the caller cannot
// predict, and a mispredicted branch per probe costs more than the whole window scan. A run
// longer than the window, or a window that wraps past the table end, takes the cell-by-cell
// path (rare at load <= 1/2).
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
#include "cache/window_masks.h"

namespace bagpipe::cache {

class SlotMap {
 public:
  static constexpr size_t kWindow = kWindowCells;
  static constexpr bool kExact = false;  // a Candidate shares a tag: the caller checks its key

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

  // The hash every other call takes as `h` for `key`.
  static uint64_t HashOf(int64_t key) { return MixKey(key); }

  // Keys stored, and the cells' bytes.
  size_t size() const { return size_; }
  size_t memory_bytes() const { return cells_.memory_bytes(); }

  // Hints the cache that the key of hash h will be looked up soon.
  void Prefetch(uint64_t h) const { __builtin_prefetch(&cells_[Home(Tag(h))]); }

  // The slot of the first cell of the key's run whose tag matches h, or -1: the key's slot
  // unless another key has the same tag (the caller checks key_of).
  int32_t Candidate(uint64_t h) const {
    const uint32_t tag = Tag(h);
    const size_t home = Home(tag);
    if (home + kWindow <= cells_.size()) {
      const uint64_t* c = &cells_[home];
      uint32_t match, empty;
      TagAndZeroMasks(c, tag, &match, &empty);
      match &= ~empty & ((empty & (0u - empty)) - 1u);  // non-empty, before the first empty
      if ((match | empty) != 0) {
        const uint32_t pos = static_cast<uint32_t>(__builtin_ctz(match | (1u << kWindow)));
        const int32_t slot = SlotOf(c[pos & (kWindow - 1)]);
        return pos < kWindow ? slot : -1;
      }
    }
    for (size_t i = home;; i = (i + 1) & mask_) {
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
    const uint64_t cell = (static_cast<uint64_t>(tag) << 32) | (static_cast<uint32_t>(slot) + 1u);
    size_t i = Home(tag);
    ++size_;
    if (i + kWindow <= cells_.size()) {
      const uint32_t empty = EmptyMask(i);
      if (empty != 0) {
        cells_[i + static_cast<size_t>(__builtin_ctz(empty))] = cell;
        return;
      }
    }
    while (cells_[i] != 0) i = (i + 1) & mask_;
    cells_[i] = cell;
  }

  // Removes the cell of `slot`, whose key has hash h. REQUIRES: it is present.
  void Erase(uint64_t h, int32_t slot) {
    const uint32_t tag = Tag(h);
    const uint64_t want = (static_cast<uint64_t>(tag) << 32) | (static_cast<uint32_t>(slot) + 1u);
    size_t hole = Home(tag);
    if (hole + kWindow <= cells_.size()) {
      const uint32_t eq = EqualMask(&cells_[hole], want);
      hole += static_cast<size_t>(__builtin_ctz(eq | (1u << kWindow)));
    }
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

  // Removes every key; the capacity stays.
  void Clear() {
    if (cells_.size() > 0) std::memset(cells_.data(), 0, cells_.size() * sizeof(uint64_t));
    size_ = 0;
  }

 private:
  static uint32_t Tag(uint64_t h) { return static_cast<uint32_t>(h >> 32); }
  size_t Home(uint32_t tag) const { return static_cast<size_t>(tag >> shift_); }
  static int32_t SlotOf(uint64_t c) { return static_cast<int32_t>(static_cast<uint32_t>(c) - 1u); }
  // REQUIRES: i + kWindow <= cells.
  uint32_t EmptyMask(size_t i) const { return EqualMask(&cells_[i], 0); }

  HugeArray<uint64_t> cells_;
  size_t mask_ = 0;
  int shift_ = 32;
  size_t size_ = 0;
};

}  // namespace bagpipe::cache
