// KeySet: a scratch set of non-negative int64 keys for one call's uniqueness check. Cells
// are bare keys (8 bytes, -1 empty); Reset clears only the cells the next call needs, so a
// small call after a large one costs what a small call costs. Insert scans a window of cells
// at once (bit masks, as SlotMap does) instead of branching per cell.
//
// Thread safety: none; owned by one object that serializes access.
//
// Invariants:
//   1. After Reset(n) the table has a power-of-two number of cells >= 2n + 2, all empty.
//   2. Stored keys are >= 0 (callers validate this first); linear probing, no deletion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache/window_masks.h"

namespace bagpipe::cache {

class KeySet {
 public:
  // Empties the set and makes room for n keys.
  void Reset(size_t n) {
    size_t cells = 16;
    while (cells < 2 * n + 2) cells <<= 1;
    if (cells > cells_.size()) cells_.resize(cells);
    mask_ = cells - 1;
    std::memset(cells_.data(), 0xff, cells * sizeof(int64_t));  // every cell -1
  }

  // Hints the cache that a key of hash h will be inserted soon.
  void Prefetch(uint64_t h) const { __builtin_prefetch(&cells_[h & mask_]); }

  // Adds key (hash h); returns false when it was already present.
  // REQUIRES: key >= 0; fewer than n keys added since Reset(n).
  bool Insert(int64_t key, uint64_t h) {
    const size_t home = h & mask_;
    if (home + kWindowCells <= mask_ + 1) {
      uint32_t eq, empty;
      EqualAndNegativeMasks(&cells_[home], key, &eq, &empty);
      if (empty != 0) {
        const uint32_t first_empty = empty & (0u - empty);
        if ((eq & (first_empty - 1u)) != 0) return false;
        cells_[home + static_cast<size_t>(__builtin_ctz(empty))] = key;
        return true;
      }
    }
    for (size_t i = home;; i = (i + 1) & mask_) {
      const int64_t c = cells_[i];
      if (c == key) return false;
      if (c < 0) {
        cells_[i] = key;
        return true;
      }
    }
  }

  // Bytes of the cells allocated (the largest Reset so far).
  size_t memory_bytes() const { return cells_.capacity() * sizeof(int64_t); }

 private:
  std::vector<int64_t> cells_;
  size_t mask_ = 0;
};

}  // namespace bagpipe::cache
