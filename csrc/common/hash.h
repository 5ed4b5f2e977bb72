// The one 64-bit byte/integer hash of the native code: FNV-1a over bytes, then MurmurHash3's
// 64-bit finaliser (fmix64). Three contracts are defined in terms of it, and each is pinned
// by reference values in tests, so neither function may change:
//   * the partitioner's hash / fast_range routing of a key (protocol/partitioner.h),
//   * the job-token digest stamped into every frame (protocol/wire.h TokenDigest),
//   * the digest of a UCX packed remote key (transport/ucx_memory.h KeyDigest).
// (The store's own key routing and row initialisation use SplitMix64, store/splitmix64.h: a
// different function on purpose, so a shard's keys still spread over its store's shards.)
//
// Thread safety: pure functions.
//
// Invariants:
//   1. Fmix64 is a bijection on uint64 (each step is invertible), so it never merges keys.
//   2. Digest64(p, n) depends only on the n bytes at p: Digest64 of equal byte strings is
//      equal, whatever their alignment or origin.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace bagpipe {

// MurmurHash3's 64-bit finaliser.
inline constexpr uint64_t Fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

// 64-bit FNV-1a of n bytes. REQUIRES: data holds n readable bytes (any alignment).
inline uint64_t Fnv1a64(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

// The digest of a byte string: Fmix64(Fnv1a64(bytes)). Not a MAC.
inline uint64_t Digest64(const void* data, size_t n) { return Fmix64(Fnv1a64(data, n)); }
inline uint64_t Digest64(std::string_view bytes) { return Digest64(bytes.data(), bytes.size()); }

}  // namespace bagpipe
