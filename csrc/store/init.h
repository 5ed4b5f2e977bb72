// Deterministic row initialisation: the value of a row that was never written.
//
// The value is a pure function of (InitSpec, key, column), independent of shard count,
// thread count and history, so any process (a PS shard, a test, a trainer) can recompute
// it. For InitKind::kUniform, with u64 arithmetic modulo 2^64 and
//   SplitMix64(z) = finalizer(z + 0x9E3779B97F4A7C15)           (see splitmix64.h)
//   base  = SplitMix64(seed XOR SplitMix64(uint64(key)))
//   bits  = SplitMix64(base + column * 0x9E3779B97F4A7C15)      (column-th SplitMix64 output)
//   s     = float32(int32(bits >> 40) * 2 - 2^24) * 2^-24        (exact, in [-1, 1))
//   value = float32(s * bound(key))                              (one fp32 rounding)
// which lies in [-bound, bound). bound(key) is `bound`, or, when `bound_starts` is set, the
// value of the last range whose start is <= key (the first range for keys below every
// start): a fused table gives each member table its own TorchRec default bound.
//
// Thread safety: pure functions.
// Invariants:
//   1. The formula above is part of the checkpoint format: a build that changed it would
//      read every never-written row of an old checkpoint differently.
//   2. kZeros rows read 0 and kConstant rows `value` in every column.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bagpipe::store {

enum class InitKind : uint8_t { kUniform = 0, kZeros = 1, kConstant = 2 };

struct InitSpec {
  InitKind kind = InitKind::kUniform;
  float bound = 0.0f;  // kUniform: values in [-bound, bound)
  float value = 0.0f;  // kConstant
  uint64_t seed = 0;
  // kUniform with per-key-range bounds: strictly increasing starts, one bound each.
  std::vector<int64_t> bound_starts;
  std::vector<float> bound_values;

  bool operator==(const InitSpec&) const = default;
};

// Throws ValueError naming the field when the spec is inconsistent (negative or non-finite
// bound, mismatched or unsorted ranges, non-finite constant).
void ValidateInitSpec(const InitSpec& init);

// The bound used for `key` (kUniform).
float InitBound(const InitSpec& init, int64_t key);

// Writes the initial row of `key` (dim floats). `key_hash` must be KeyHash(key).
void InitRow(const InitSpec& init, int dim, int64_t key, uint64_t key_hash, float* out);

}  // namespace bagpipe::store
