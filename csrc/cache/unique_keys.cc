#include "cache/unique_keys.h"

#include "cache/flat_map.h"

namespace bagpipe::cache {

namespace {
constexpr size_t kPrefetchDistance = 16;
}  // namespace

void UniqueKeys(const int64_t* keys, size_t n, std::vector<int64_t>* out, int64_t* inverse) {
  thread_local StampedMap<int64_t> seen;
  seen.Reset(n);
  out->clear();
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchDistance < n) seen.Prefetch(keys[i + kPrefetchDistance]);
    auto [v, inserted] = seen.FindOrInsert(keys[i], static_cast<int64_t>(out->size()));
    if (inserted) out->push_back(keys[i]);
    if (inverse != nullptr) inverse[i] = *v;
  }
}

}  // namespace bagpipe::cache
