#include "commit/table_backend.h"

#include <cstring>

namespace bagpipe::commit {

void TableBackend::ApplySgdSegments(const store::GradSegment* segs, size_t count, float lr,
                                  int grad_divisor) {
  const size_t dim = schema().dim;
  size_t n = 0;
  for (size_t s = 0; s < count; ++s) n += segs[s].n;
  concat_keys_.resize(n);
  concat_grads_.resize(n * dim);
  size_t at = 0;
  for (size_t s = 0; s < count; ++s) {
    if (segs[s].n == 0) continue;
    std::memcpy(concat_keys_.data() + at, segs[s].keys, segs[s].n * sizeof(int64_t));
    std::memcpy(concat_grads_.data() + at * dim, segs[s].grads, segs[s].n * dim * sizeof(float));
    at += segs[s].n;
  }
  ApplySgd(concat_keys_.data(), n, concat_grads_.data(), lr, grad_divisor);
}

}  // namespace bagpipe::commit
