// UniqueKeys: the distinct keys of a batch in first-occurrence order (the order the step
// planner assigns unique indices in), with an optional inverse.
//
// Thread safety: the scratch hash table is thread-local; calls on different threads are
// independent.
//
// Invariants:
//   1. out[j] is the j-th distinct key of keys[0..n) in order of first occurrence.
//   2. With inverse != nullptr, keys[i] == out[inverse[i]] for every i.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bagpipe::cache {

// REQUIRES: keys has n entries (any values); inverse, if given, has room for n entries.
void UniqueKeys(const int64_t* keys, size_t n, std::vector<int64_t>* out,
                int64_t* inverse = nullptr);

}  // namespace bagpipe::cache
