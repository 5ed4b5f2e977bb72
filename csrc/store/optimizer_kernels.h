// The per-row update kernels of an EmbeddingStore: the arithmetic contract of
// embedding_store.h, one fp32 operation per step (the core is built with -ffp-contract=off,
// so no multiply-add is fused). kDim > 0 fixes the trip counts at compile time; 0 reads the
// dimension from StepArgs.
//
// Thread safety: pure functions of their arguments; a caller gives each thread its own
// scratch.
//
// Invariants:
//   1. A kernel reads the row's weights, state and gradient and writes only that row's
//      weights and state (and its scratch): a NaN or inf stays within its row.
//   2. The result depends on nothing but the arguments (no thread count, no order).
#pragma once

#include <cmath>
#include <cstring>

#include "store/optimizer.h"

namespace bagpipe::store {

// The values one update call applies to every row.
struct StepArgs {
  float lr = 0.0f;     // the step's lr (Adam: the bias-corrected step size)
  float div = 1.0f;    // float(grad_divisor)
  bool divide = false; // grad_divisor != 1
  float wd = 0.0f;     // float(weight_decay)
  bool decay = false;  // wd != 0
  float eps = 0.0f;
  float c1 = 0.0f;     // Adam: float(1 - beta1)
  float c2 = 0.0f;     // Adam: float(1 - beta2)
  float fdim = 0.0f;   // float(dim)
  int dim = 0;
  int padded = 0;      // the smallest power of two >= dim (the row-sum tree's width)
};

// A kernel's scratch: the scaled gradient (dim floats, rounded up to 16), then the row-sum
// tree (padded floats). REQUIRES of the caller: 64-byte aligned.
inline constexpr size_t kScratchAlign = 64;
// Floats of a kernel's scratch for dim and padded (the row-sum tree's width).
inline size_t KernelScratchFloats(int dim, int padded) {
  return (static_cast<size_t>(dim) + 15) / 16 * 16 + static_cast<size_t>(padded);
}

namespace kernels {

template <int kDim>
constexpr int PaddedDim() {
  int p = 1;
  while (p < kDim) p *= 2;
  return p;
}

// 16 fp32 lanes (GCC / Clang vector extensions): lane-wise + and * are the IEEE fp32
// operations of the scalar code, so a tree level over whole vectors adds exactly the pairs
// the scalar tree adds.
using Vec16 = float __attribute__((vector_size(64)));
using Vec8 = float __attribute__((vector_size(32)));
using Vec4 = float __attribute__((vector_size(16)));

// 16 floats from p, unaligned. REQUIRES: p holds 16 readable floats.
inline Vec16 Load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Contract step 7 on the squares of u[0..dim): the pairwise tree over `padded` columns
// (zero-padded). Levels of 16 columns or more add whole vectors (x[i] + x[i + h], h in
// vectors); the last four levels halve one vector (8, 4, 2, 1 columns). x: padded / 16
// vectors of scratch (unused when padded < 16).
template <int kDim>
inline float PairwiseSumOfSquares(const float* __restrict u, int dim, int padded,
                                  Vec16* __restrict x) {
  if (padded < 16) {  // dim <= 8: a scalar tree on a few registers
    float y[16];
    for (int c = 0; c < dim; ++c) y[c] = u[c] * u[c];
    for (int c = dim; c < padded; ++c) y[c] = 0.0f;
    for (int h = padded / 2; h >= 1; h /= 2) {
      for (int c = 0; c < h; ++c) y[c] = y[c] + y[c + h];
    }
    return y[0];
  }
  const int vectors = padded / 16;
  const int full = dim / 16;
  for (int i = 0; i < full; ++i) {
    const Vec16 t = Load16(u + 16 * i);
    x[i] = t * t;
  }
  int next = full;
  if (dim % 16 != 0) {  // the row's last columns, zero lanes after them (0 * 0 = +0)
    float tail[16] = {};
    std::memcpy(tail, u + 16 * full, static_cast<size_t>(dim % 16) * sizeof(float));
    const Vec16 t = Load16(tail);
    x[next++] = t * t;
  }
  for (int i = next; i < vectors; ++i) x[i] = Vec16{};
  for (int h = vectors / 2; h >= 1; h /= 2) {
    for (int i = 0; i < h; ++i) x[i] = x[i] + x[i + h];
  }
  const Vec16 v = x[0];
  const Vec8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) +
                  __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
  const float a0 = v4[0] + v4[2];
  const float a1 = v4[1] + v4[3];
  return a0 + a1;
}

// Step 1 of the contract: u = G / float(W) (when W != 1), then u = u + w * wd (when wd != 0).
template <int kDim>
inline void ScaledGradient(float* __restrict u, const float* __restrict g,
                           const float* __restrict w, const StepArgs& a) {
  // Locals: a float store through u may not alias them (the loops stay vectorizable).
  const int dim = kDim > 0 ? kDim : a.dim;
  const float div = a.div, wd = a.wd;
  if (a.divide) {
    for (int c = 0; c < dim; ++c) u[c] = g[c] / div;
  } else {
    std::memcpy(u, g, static_cast<size_t>(dim) * sizeof(float));
  }
  if (a.decay) {
    for (int c = 0; c < dim; ++c) {
      const float t = w[c] * wd;
      u[c] = u[c] + t;
    }
  }
}

// The scaled gradient of the row: g itself when there is nothing to scale.
template <int kDim>
inline const float* Scaled(float* __restrict scratch, const float* g, const float* w,
                           const StepArgs& a) {
  if (!a.divide && !a.decay) return g;
  ScaledGradient<kDim>(scratch, g, w, a);
  return scratch;
}

// SGD: w = w - u * lr.
template <int kDim>
inline void SgdRow(float* __restrict w, const float* __restrict g, const StepArgs& a,
                   float* __restrict scratch) {
  const int dim = kDim > 0 ? kDim : a.dim;
  const float lr = a.lr, div = a.div;
  if (!a.decay) {  // one pass, no scratch (the hot loop of SGD stores)
    if (a.divide) {
      for (int c = 0; c < dim; ++c) {
        float u = g[c] / div;
        u = u * lr;
        w[c] = w[c] - u;
      }
    } else {
      for (int c = 0; c < dim; ++c) {
        const float u = g[c] * lr;
        w[c] = w[c] - u;
      }
    }
    return;
  }
  ScaledGradient<kDim>(scratch, g, w, a);
  for (int c = 0; c < dim; ++c) {
    const float t = scratch[c] * lr;
    w[c] = w[c] - t;
  }
}

// Adagrad: s = s + u*u; d = sqrt(s) + eps; w = w - (u / d) * lr.
template <int kDim>
inline void AdagradRow(float* __restrict w, float* __restrict s, const float* g,
                       const StepArgs& a, float* scratch) {
  const int dim = kDim > 0 ? kDim : a.dim;
  const float* __restrict u = Scaled<kDim>(scratch, g, w, a);
  const float lr = a.lr, eps = a.eps;
  for (int c = 0; c < dim; ++c) {
    const float uc = u[c];
    const float sq = uc * uc;
    const float sc = s[c] + sq;
    s[c] = sc;
    const float d = std::sqrt(sc) + eps;
    const float q = uc / d;
    const float t = q * lr;
    w[c] = w[c] - t;
  }
}

// Row-wise Adagrad: r = rowsum(u*u) / float(dim) over the fixed pairwise tree (zero-padded
// to a power of two, halves added until one column is left); s = s + r;
// d = sqrt(s) + eps; m = lr / d; w = w - u * m.
template <int kDim>
inline void RowWiseAdagradRow(float* __restrict w, float* __restrict s, const float* g,
                              const StepArgs& a, float* scratch) {
  const int dim = kDim > 0 ? kDim : a.dim;
  const int padded = kDim > 0 ? PaddedDim<kDim>() : a.padded;
  const float lr = a.lr, eps = a.eps, fdim = a.fdim;
  const float* __restrict u = Scaled<kDim>(scratch, g, w, a);
  // The tree: in registers for a fixed width, else in the scratch after the scaled gradient.
  constexpr int kLocal = kDim > 0 && PaddedDim<kDim>() >= 16 ? PaddedDim<kDim>() / 16 : 1;
  Vec16 local[kLocal];
  float* tree = scratch + (static_cast<size_t>(dim) + 15) / 16 * 16;  // 64-byte aligned
  Vec16* x = kDim > 0 ? local : reinterpret_cast<Vec16*>(tree);
  const float r = PairwiseSumOfSquares<kDim>(u, dim, padded, x) / fdim;
  const float sc = s[0] + r;
  s[0] = sc;
  const float d = std::sqrt(sc) + eps;
  const float m = lr / d;
  for (int c = 0; c < dim; ++c) {
    const float t = u[c] * m;
    w[c] = w[c] - t;
  }
}

// Adam (lazy): m = m + (u - m) * c1; v = v + (u*u - v) * c2; d = sqrt(v) + eps;
// w = w - (m / d) * lr. The state holds m[0..dim) then v[0..dim).
template <int kDim>
inline void AdamRow(float* __restrict w, float* __restrict s, const float* g, const StepArgs& a,
                    float* scratch) {
  const int dim = kDim > 0 ? kDim : a.dim;
  const float* __restrict u = Scaled<kDim>(scratch, g, w, a);
  float* __restrict m = s;
  float* __restrict v = s + dim;
  const float lr = a.lr, eps = a.eps, c1 = a.c1, c2 = a.c2;
  for (int c = 0; c < dim; ++c) {
    const float uc = u[c];
    const float dm = (uc - m[c]) * c1;
    const float mc = m[c] + dm;
    m[c] = mc;
    const float sq = uc * uc;
    const float dv = (sq - v[c]) * c2;
    const float vc = v[c] + dv;
    v[c] = vc;
    const float d = std::sqrt(vc) + eps;
    const float q = mc / d;
    const float t = q * lr;
    w[c] = w[c] - t;
  }
}

// One row of optimizer kKind. state: StateDim(kKind, dim) floats (unused for SGD); g: the
// key's summed gradient; scratch: KernelScratchFloats(dim, padded) floats.
template <int kDim, OptimizerKind kKind>
inline void UpdateRow(float* w, float* state, const float* g, const StepArgs& a, float* scratch) {
  if constexpr (kKind == OptimizerKind::kSgd) {
    SgdRow<kDim>(w, g, a, scratch);
  } else if constexpr (kKind == OptimizerKind::kAdagrad) {
    AdagradRow<kDim>(w, state, g, a, scratch);
  } else if constexpr (kKind == OptimizerKind::kRowWiseAdagrad) {
    RowWiseAdagradRow<kDim>(w, state, g, a, scratch);
  } else {
    AdamRow<kDim>(w, state, g, a, scratch);
  }
}

}  // namespace kernels
}  // namespace bagpipe::store
