#include <cstdint>
#include <random>
#include <vector>

#include "cache/unique_keys.h"
#include "tests/test_harness.h"

using bagpipe::cache::UniqueKeys;

TEST_CASE(unique_keys_first_occurrence_order_and_inverse) {
  std::mt19937_64 rng(3);
  std::vector<int64_t> out;
  for (int round = 0; round < 50; ++round) {
    const size_t n = rng() % 300;
    std::vector<int64_t> keys(n);
    for (auto& k : keys) k = static_cast<int64_t>(rng() % 97) - 3;  // negatives are keys too
    std::vector<int64_t> inverse(n, -7);
    UniqueKeys(keys.data(), n, &out, inverse.data());
    std::vector<int64_t> want;
    for (auto k : keys) {
      bool seen = false;
      for (auto w : want) seen = seen || w == k;
      if (!seen) want.push_back(k);
    }
    CHECK(out == want);
    for (size_t i = 0; i < n; ++i) CHECK_EQ(out[inverse[i]], keys[i]);
    std::vector<int64_t> again;
    UniqueKeys(keys.data(), n, &again);  // without inverse, reusing the scratch table
    CHECK(again == want);
  }
}
