// Integer mixing shared by the key map (shard and bucket choice) and the deterministic
// initialiser. Both functions are part of the storage format's contract: the initial value
// of a row is defined in terms of SplitMix64 (see init.h), and tests re-implement it.
//
// Thread safety: pure functions.
// Invariants:
//   1. Fixed by the storage format: changing either changes the initial value of every
//      never-written row (init.h) and the hash shard of every key.
#pragma once

#include <cstdint>

namespace bagpipe::store {

inline constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;

// The SplitMix64 output function applied to z + gamma: the first output of a SplitMix64
// generator whose state is z.
inline uint64_t SplitMix64(uint64_t z) {
  z += kGoldenGamma;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The hash of a key for routing: top bits choose the shard, the rest the bucket.
inline uint64_t KeyHash(int64_t key) { return SplitMix64(static_cast<uint64_t>(key)); }

}  // namespace bagpipe::store
