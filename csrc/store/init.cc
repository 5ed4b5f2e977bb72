#include "store/init.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/errors.h"
#include "store/splitmix64.h"

namespace bagpipe::store {

void ValidateInitSpec(const InitSpec& init) {
  auto bad_bound = [](float b) { return !std::isfinite(b) || b < 0.0f; };
  switch (init.kind) {
    case InitKind::kUniform:
      if (init.bound_starts.size() != init.bound_values.size()) {
        throw ValueError("init_bound: " + std::to_string(init.bound_starts.size()) +
                         " range starts but " + std::to_string(init.bound_values.size()) +
                         " bounds");
      }
      if (init.bound_starts.empty()) {
        if (bad_bound(init.bound)) throw ValueError("init_bound must be finite and >= 0");
      }
      for (size_t i = 0; i < init.bound_starts.size(); ++i) {
        if (bad_bound(init.bound_values[i])) {
          throw ValueError("init_bound: range " + std::to_string(i) +
                           " has a bound that is not finite and >= 0");
        }
        if (i > 0 && init.bound_starts[i] <= init.bound_starts[i - 1]) {
          throw ValueError("init_bound: range starts must be strictly increasing");
        }
      }
      break;
    case InitKind::kZeros:
      break;
    case InitKind::kConstant:
      if (!std::isfinite(init.value)) throw ValueError("init_value must be finite");
      break;
    default:
      throw ValueError("init: unknown kind " + std::to_string(static_cast<int>(init.kind)));
  }
}

float InitBound(const InitSpec& init, int64_t key) {
  if (init.bound_starts.empty()) return init.bound;
  auto it = std::upper_bound(init.bound_starts.begin(), init.bound_starts.end(), key);
  const size_t i = it == init.bound_starts.begin() ? 0 : (it - init.bound_starts.begin()) - 1;
  return init.bound_values[i];
}

void InitRow(const InitSpec& init, int dim, int64_t key, uint64_t key_hash, float* out) {
  switch (init.kind) {
    case InitKind::kZeros:
      std::fill(out, out + dim, 0.0f);
      return;
    case InitKind::kConstant:
      std::fill(out, out + dim, init.value);
      return;
    case InitKind::kUniform:
      break;
  }
  const float bound = InitBound(init, key);
  const uint64_t base = SplitMix64(init.seed ^ key_hash);
  uint64_t z = base;
  for (int c = 0; c < dim; ++c, z += kGoldenGamma) {
    const uint64_t bits = SplitMix64(z);
    const int32_t k = static_cast<int32_t>(bits >> 40) * 2 - (int32_t{1} << 24);
    const float s = static_cast<float>(k) * 0x1p-24f;
    out[c] = s * bound;
  }
}

}  // namespace bagpipe::store
