// Bit masks over a window of 8 consecutive 64-bit hash-table cells: which cells hold a given
// tag / value, which are empty. SlotMap and KeySet probe with them instead of branching per
// cell, since whether a probed key is present is data no branch predictor can learn.
//
// With AVX2 (e.g. -march=native on a current x86 CPU) a window is two 256-bit compares per
// mask; otherwise the same masks come from a scalar loop.
//
// Thread safety: pure functions.
//
// Invariants:
//   1. Bit k of every mask describes cell c[k], k in [0, kWindowCells); the other bits are 0.
//   2. The AVX2 and the scalar versions return equal masks for equal cells.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace bagpipe::cache {

inline constexpr size_t kWindowCells = 8;

#if defined(__AVX2__)

namespace window_detail {
// Bit k: the sign bit of 64-bit lane k of lo (cells 0-3) and of hi (cells 4-7).
inline uint32_t Mask(__m256i lo, __m256i hi) {
  return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(lo))) |
         (static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(hi))) << 4);
}
}  // namespace window_detail

// Cells whose high 32 bits equal `tag` (match) and cells equal to 0 (empty).
// REQUIRES (every mask function): c points at kWindowCells readable cells.
inline void TagAndZeroMasks(const uint64_t* c, uint32_t tag, uint32_t* match, uint32_t* empty) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 4));
  const __m256i high = _mm256_set1_epi64x(static_cast<int64_t>(0xFFFFFFFF00000000ull));
  const __m256i t = _mm256_set1_epi64x(static_cast<int64_t>(static_cast<uint64_t>(tag) << 32));
  const __m256i zero = _mm256_setzero_si256();
  *match = window_detail::Mask(_mm256_cmpeq_epi64(_mm256_and_si256(v0, high), t),
                               _mm256_cmpeq_epi64(_mm256_and_si256(v1, high), t));
  *empty = window_detail::Mask(_mm256_cmpeq_epi64(v0, zero), _mm256_cmpeq_epi64(v1, zero));
}

// Cells equal to `v`.
inline uint32_t EqualMask(const uint64_t* c, uint64_t v) {
  const __m256i x = _mm256_set1_epi64x(static_cast<int64_t>(v));
  return window_detail::Mask(
      _mm256_cmpeq_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), x),
      _mm256_cmpeq_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 4)), x));
}

// Cells equal to `v` (eq) and negative cells (neg).
inline void EqualAndNegativeMasks(const int64_t* c, int64_t v, uint32_t* eq, uint32_t* neg) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 4));
  const __m256i x = _mm256_set1_epi64x(v);
  *eq = window_detail::Mask(_mm256_cmpeq_epi64(v0, x), _mm256_cmpeq_epi64(v1, x));
  *neg = window_detail::Mask(v0, v1);  // the sign bits
}

#else  // scalar

// As the AVX2 TagAndZeroMasks above, one cell at a time.
inline void TagAndZeroMasks(const uint64_t* c, uint32_t tag, uint32_t* match, uint32_t* empty) {
  uint32_t m = 0, e = 0;
  for (size_t k = 0; k < kWindowCells; ++k) {
    m |= static_cast<uint32_t>(static_cast<uint32_t>(c[k] >> 32) == tag) << k;
    e |= static_cast<uint32_t>(c[k] == 0) << k;
  }
  *match = m;
  *empty = e;
}

// As the AVX2 EqualMask above.
inline uint32_t EqualMask(const uint64_t* c, uint64_t v) {
  uint32_t m = 0;
  for (size_t k = 0; k < kWindowCells; ++k) m |= static_cast<uint32_t>(c[k] == v) << k;
  return m;
}

// As the AVX2 EqualAndNegativeMasks above.
inline void EqualAndNegativeMasks(const int64_t* c, int64_t v, uint32_t* eq, uint32_t* neg) {
  uint32_t e = 0, n = 0;
  for (size_t k = 0; k < kWindowCells; ++k) {
    e |= static_cast<uint32_t>(c[k] == v) << k;
    n |= static_cast<uint32_t>(c[k] < 0) << k;
  }
  *eq = e;
  *neg = n;
}

#endif

}  // namespace bagpipe::cache
