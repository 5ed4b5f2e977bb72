// Partitioner: which PS shard owns a fused row key. Every runtime that routes keys (the
// client, offline restore, tests) must map keys identically; tests pin the mapping with
// reference vectors.
//
// Thread safety: immutable after construction; every method is const and thread-safe.
//
// Invariants:
//   1. ShardOf(key) is a pure function of (kind, num_shards, key) and lies in [0, num_shards).
//   2. Split is stable: within one shard, indices appear in input order (so duplicate keys
//      of one rank keep their summation order whatever the shard count).
//   3. The hash used by kHash / kFastRange (Fmix64 of common/hash.h, the murmur3 64-bit
//      finaliser, applied to the key's bit pattern) differs from the store's internal SplitMix64 routing, so a shard's keys still
//      spread over all of its store's internal shards.
//
// Definitions (k = the key's int64 bit pattern as uint64, S = num_shards):
//   modulo:     k mod S
//   hash:       Fmix64(k) mod S
//   fast_range: (Fmix64(k) * S) >> 64     (Lemire's multiply-shift range reduction)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/hash.h"

namespace bagpipe::protocol {

enum class PartitionKind : uint8_t { kModulo = 0, kHash = 1, kFastRange = 2 };

class Partitioner {
 public:
  // REQUIRES: num_shards >= 1 (ValueError otherwise).
  Partitioner(PartitionKind kind, uint32_t num_shards);

  // REQUIRES: name is "modulo", "hash" or "fast_range" (ValueError naming it otherwise).
  static PartitionKind ParseKind(std::string_view name);
  // The name ParseKind reads ("unknown" for a value outside the enum).
  static const char* KindName(PartitionKind kind);

  // As constructed.
  PartitionKind kind() const { return kind_; }
  uint32_t num_shards() const { return num_shards_; }

  // The shard of `key`, in [0, num_shards()): a pure function of (kind, num_shards, key).
  uint32_t ShardOf(int64_t key) const {
    const uint64_t k = static_cast<uint64_t>(key);
    switch (kind_) {
      case PartitionKind::kModulo:
        return static_cast<uint32_t>(k % num_shards_);
      case PartitionKind::kHash:
        return static_cast<uint32_t>(Fmix64(k) % num_shards_);
      case PartitionKind::kFastRange:
        return static_cast<uint32_t>(
            (static_cast<unsigned __int128>(Fmix64(k)) * num_shards_) >> 64);
    }
    return 0;
  }

  // Writes the shard of keys[i] into shard_out[i].
  void Assign(const int64_t* keys, size_t n, uint32_t* shard_out) const;

  // Stable counting sort of positions by shard: afterwards the positions of shard s are
  // order[offsets[s] .. offsets[s+1]). `shards` is scratch (resized to n); buffers keep
  // their capacity across calls.
  void Split(const int64_t* keys, size_t n, std::vector<uint32_t>* shards,
             std::vector<int64_t>* order, std::vector<size_t>* offsets) const;

 private:
  PartitionKind kind_;
  uint32_t num_shards_;
};

}  // namespace bagpipe::protocol
