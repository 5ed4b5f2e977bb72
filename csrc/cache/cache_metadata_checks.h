// Argument validation of the cache metadata's calls (cache_metadata.h invariants 6 and 7):
// each check reduces over its array first (vectorized, no branch per element) and only on
// failure looks for the position it names in the ValueError. Internal to the cache_metadata*
// files.
//
// Thread safety: pure functions.
//
// Invariants:
//   1. A check either returns (every element valid) or throws ValueError naming the first
//      invalid position and its value; it never reads outside [0, n).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/errors.h"

namespace bagpipe::cache::metadata_checks {

inline std::string Pos(const char* what, const char* arr, size_t i, int64_t v) {
  return std::string(what) + ": " + arr + "[" + std::to_string(i) + "] = " + std::to_string(v);
}

// Keys in [0, bound); bound < 0: only >= 0.
inline void CheckKeyRange(const int64_t* keys, size_t n, int64_t bound, const char* what) {
  int64_t low = 0, high = 0;
  for (size_t i = 0; i < n; ++i) {
    low = std::min(low, keys[i]);
    high = std::max(high, keys[i]);
  }
  if (low >= 0 && (bound < 0 || high < bound)) return;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0) throw ValueError(Pos(what, "keys", i, keys[i]) + " is negative");
    if (bound >= 0 && keys[i] >= bound) {
      throw ValueError(Pos(what, "keys", i, keys[i]) + " is outside the key bound [0, " +
                       std::to_string(bound) + ") (the table's rows)");
    }
  }
}

// Next uses are stored in 32 bits with INT32_MAX as kNever32 (invariant 7).
inline void CheckNextUses(const int64_t* next_uses, size_t n, const char* what) {
  int64_t high = 0;
  for (size_t i = 0; i < n; ++i) high = std::max(high, next_uses[i]);
  if (high < INT32_MAX) return;
  for (size_t i = 0; i < n; ++i) {
    if (next_uses[i] >= INT32_MAX) {
      throw ValueError(Pos(what, "next_uses", i, next_uses[i]) +
                       " is not a step (next uses must be < 2^31 - 1)");
    }
  }
}

// A value stored in 32 bits (invariant 7): [INT32_MIN, INT32_MAX), INT32_MAX is kNever32.
inline bool Fits32(int64_t v) { return v >= INT32_MIN && v < INT32_MAX; }

inline void CheckVersions(const int64_t* versions, size_t n, const char* what) {
  int64_t low = 0, high = 0;
  for (size_t i = 0; i < n; ++i) {
    low = std::min(low, versions[i]);
    high = std::max(high, versions[i]);
  }
  if (Fits32(low) && Fits32(high)) return;
  for (size_t i = 0; i < n; ++i) {
    if (!Fits32(versions[i])) {
      throw ValueError(Pos(what, "versions", i, versions[i]) + " does not fit in 32 bits");
    }
  }
}

inline void CheckSlotRange(const int64_t* slots, size_t n, int64_t capacity, const char* what) {
  int64_t low = 0, high = 0;
  for (size_t i = 0; i < n; ++i) {
    low = std::min(low, slots[i]);
    high = std::max(high, slots[i]);
  }
  if (low >= 0 && high < capacity) return;
  for (size_t i = 0; i < n; ++i) {
    if (slots[i] < 0 || slots[i] >= capacity) {
      throw ValueError(std::string(what) + ": slot " + std::to_string(slots[i]) +
                       " outside [0, " + std::to_string(capacity) + ")");
    }
  }
}

inline void CheckStep32(int64_t v, const char* what, const char* name) {
  if (!Fits32(v)) {
    throw ValueError(std::string(what) + ": " + name + " " + std::to_string(v) +
                     " does not fit in 32 bits (steps lie in [-2^31, 2^31 - 1))");
  }
}

inline void CheckRepeat(const int64_t* keys, size_t repeat, size_t n, const char* what) {
  if (repeat < n) {
    throw ValueError(std::string(what) + ": keys must be unique, key " +
                     std::to_string(keys[repeat]) + " repeats at position " +
                     std::to_string(repeat));
  }
}

}  // namespace bagpipe::cache::metadata_checks
