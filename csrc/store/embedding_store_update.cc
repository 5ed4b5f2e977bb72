// The write path: Assign, and the optimizer updates (ApplyGradients, ApplyGradientsSegments),
// one row kernel call per distinct key (the arithmetic contract of embedding_store.h).
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/errors.h"
#include "store/embedding_store_impl.h"

namespace bagpipe::store {

void EmbeddingStore::Impl::Assign(const int64_t* keys, size_t n, const float* rows,
                                  const float* state) {
  if (state_dim_ == 0) state = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  if (n == 0) return;
  ++epoch_;
  Route(keys, n);
  ReserveAside();
  Materialize(keys);
  ++mutations_;
  const bool track = spill_.tracking();
  const uint32_t epoch = epoch_;
  RunShards([&](Shard& sh, uint32_t b, uint32_t) {
    // New rows are fully overwritten: no initialisation of their weights; their state
    // starts from the initial state unless it is assigned too. Each distinct key takes the
    // row (and state) of its last occurrence.
    Publish(sh, /*init_rows=*/false, /*init_state=*/state == nullptr, epoch);
    for (const Shard::Group& grp : sh.groups) {
      const size_t last = order_[b + grp.last];
      Preserve(sh, grp.slot);
      std::memcpy(Row(grp.slot), rows + last * dim_, row_bytes_);
      if (state != nullptr) std::memcpy(State(grp.slot), state + last * state_dim_, state_bytes_);
      MarkDirty(sh, grp.slot, grp.key);
      if (track) Touch(grp.slot, epoch);
    }
  });
  for (auto& sh : shards_) updates_ += static_cast<int64_t>(sh->groups.size());
  Finish();
}

namespace {
template <int kDim>
inline void AddRow(float* __restrict a, const float* __restrict g, int runtime_dim) {
  const int dim = kDim > 0 ? kDim : runtime_dim;
  for (int c = 0; c < dim; ++c) a[c] = a[c] + g[c];
}
}  // namespace

// One update per group, in group order: the gradient rows of a key's occurrences are summed
// in input order (the first copied, the rest added), then applied once by the optimizer's
// row kernel. Rows (and states) were prefetched for writing by Materialize.
template <int kDim, bool kRowTable, OptimizerKind kKind>
void EmbeddingStore::Impl::UpdateShard(Shard& sh, uint32_t b, const float* grads,
                                       const float* const* grad_rows, const StepArgs& args) {
  const size_t ng = sh.groups.size();
  const bool track = spill_.tracking();
  const uint32_t epoch = epoch_;
  const size_t dim = static_cast<size_t>(kDim > 0 ? kDim : dim_);
  const uint32_t* order = order_.data() + b;
  const uint32_t* next_item = sh.next_item.data();
  float* acc = sh.acc.data();          // sized by GroupShard
  // Sized by GroupShard, with room for the alignment the kernels require.
  float* scratch = reinterpret_cast<float*>(
      RoundUp(reinterpret_cast<uintptr_t>(sh.scratch.data()), kScratchAlign));
  auto row = [&](uint32_t i) -> const float* {
    if constexpr (kRowTable) {
      return grad_rows[i];
    } else {
      return grads + static_cast<size_t>(i) * dim;
    }
  };
  for (size_t g = 0; g < ng; ++g) {
    const Shard::Group& grp = sh.groups[g];
    Preserve(sh, grp.slot);
    float* w = reinterpret_cast<float*>(Row(grp.slot));
    float* state = nullptr;
    if constexpr (kKind != OptimizerKind::kSgd) state = reinterpret_cast<float*>(State(grp.slot));
    const float* grad = row(order[grp.first]);
    if (grp.count > 1) {
      std::memcpy(acc, grad, dim * sizeof(float));
      for (uint32_t k = next_item[grp.first]; k != Shard::kNoItem; k = next_item[k]) {
        AddRow<kDim>(acc, row(order[k]), dim_);
      }
      grad = acc;
    }
    kernels::UpdateRow<kDim, kKind>(w, state, grad, args, scratch);
    MarkDirty(sh, grp.slot, grp.key);
    if (track) Touch(grp.slot, epoch);
  }
}

void EmbeddingStore::Impl::RequireSgd(const char* method) const {
  if (opt_.optimizer.kind != OptimizerKind::kSgd) {
    throw ValueError(std::string("optimizer: ") + method + " needs an SGD store, this one runs '" +
                     OptimizerKindName(opt_.optimizer.kind) + "' (use ApplyGradients)");
  }
}

namespace {
void CheckStep(float lr, int divisor) {
  if (divisor < 1) throw ValueError("grad_divisor must be >= 1, got " + std::to_string(divisor));
  if (!std::isfinite(lr)) throw ValueError("lr must be finite");
}
}  // namespace

void EmbeddingStore::Impl::ApplyGradients(const int64_t* keys, size_t n, const float* grads,
                                          float lr, int divisor) {
  CheckStep(lr, divisor);
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  if (n == 0) return;
  ApplyLocked(keys, n, grads, nullptr, lr, divisor);
}

// The segments' keys are gathered (routing wants one key array, 8 bytes a row); their
// gradient rows stay where they are and are reached through a per-row pointer table, so the
// update reads every gradient byte once, as ApplyGradients on the concatenation would.
void EmbeddingStore::Impl::ApplyGradientsSegments(const GradSegment* segs, size_t count,
                                                  float lr, int divisor) {
  CheckStep(lr, divisor);
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  size_t nonempty = 0;
  const GradSegment* only = nullptr;
  for (size_t s = 0; s < count; ++s) {
    if (segs[s].n == 0) continue;
    if (segs[s].n > kMaxKeysPerCall - n) {
      throw ValueError("keys: at most " + std::to_string(kMaxKeysPerCall) +
                       " keys per call over all segments");
    }
    n += segs[s].n;
    ++nonempty;
    only = &segs[s];
  }
  if (n == 0) return;
  if (nonempty == 1) {
    CheckKeys(only->keys, n);
    ApplyLocked(only->keys, n, only->grads, nullptr, lr, divisor);
    return;
  }
  segment_keys_.resize(n);
  segment_rows_.resize(n);
  const size_t dim = static_cast<size_t>(dim_);
  size_t at = 0;
  for (size_t s = 0; s < count; ++s) {
    const GradSegment& seg = segs[s];
    if (seg.n == 0) continue;
    std::memcpy(segment_keys_.data() + at, seg.keys, seg.n * sizeof(int64_t));
    const float** rows = segment_rows_.data() + at;
    for (size_t i = 0; i < seg.n; ++i) rows[i] = seg.grads + i * dim;
    at += seg.n;
  }
  CheckKeys(segment_keys_.data(), n);
  ApplyLocked(segment_keys_.data(), n, nullptr, segment_rows_.data(), lr, divisor);
}

void EmbeddingStore::Impl::ApplyLocked(const int64_t* keys, size_t n, const float* grads,
                                       const float* const* grad_rows, float lr, int divisor) {
  ++epoch_;
  Route(keys, n);
  ReserveAside();
  Materialize(keys);
  ++mutations_;
  const uint32_t epoch = epoch_;
  const OptimizerConstants k = ConstantsOf(opt_.optimizer);
  StepArgs args;
  args.lr = lr;
  args.div = static_cast<float>(divisor);
  args.divide = divisor != 1;
  args.wd = k.weight_decay;
  args.decay = k.weight_decay != 0.0f;
  args.eps = k.eps;
  args.c1 = k.c1;
  args.c2 = k.c2;
  args.fdim = static_cast<float>(dim_);
  args.dim = dim_;
  args.padded = PaddedDim(dim_);
  // Template dispatch: the gradient addressing, the optimizer, then the dimension.
  auto by_dim = [&](auto row_table, auto kind, Shard& sh, uint32_t b) {
    constexpr bool kTable = decltype(row_table)::value;
    constexpr OptimizerKind kKind = decltype(kind)::value;
    switch (dim_) {
      case 16: return UpdateShard<16, kTable, kKind>(sh, b, grads, grad_rows, args);
      case 32: return UpdateShard<32, kTable, kKind>(sh, b, grads, grad_rows, args);
      case 64: return UpdateShard<64, kTable, kKind>(sh, b, grads, grad_rows, args);
      case 128: return UpdateShard<128, kTable, kKind>(sh, b, grads, grad_rows, args);
      default: return UpdateShard<0, kTable, kKind>(sh, b, grads, grad_rows, args);
    }
  };
  auto by_kind = [&](auto row_table, Shard& sh, uint32_t b) {
    using K = OptimizerKind;
    switch (opt_.optimizer.kind) {
      case K::kSgd:
        return by_dim(row_table, std::integral_constant<K, K::kSgd>{}, sh, b);
      case K::kAdagrad:
        return by_dim(row_table, std::integral_constant<K, K::kAdagrad>{}, sh, b);
      case K::kRowWiseAdagrad:
        return by_dim(row_table, std::integral_constant<K, K::kRowWiseAdagrad>{}, sh, b);
      case K::kAdam:
        return by_dim(row_table, std::integral_constant<K, K::kAdam>{}, sh, b);
    }
  };
  RunShards([&](Shard& sh, uint32_t b, uint32_t) {
    Publish(sh, /*init_rows=*/true, /*init_state=*/true, epoch);
    if (grad_rows != nullptr) {
      by_kind(std::true_type{}, sh, b);
    } else {
      by_kind(std::false_type{}, sh, b);
    }
  });
  for (auto& sh : shards_) updates_ += static_cast<int64_t>(sh->groups.size());
  Finish();
}

}  // namespace bagpipe::store
