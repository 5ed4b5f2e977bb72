// EmbeddingStore::ApplySgdSegments against ApplySgd on the concatenated segments: bitwise
// equal rows and equal counters, for every kernel width, with duplicates across segments,
// empty segments and bad input.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/errors.h"
#include "store/embedding_store.h"
#include "tests/test_harness.h"

using namespace bagpipe::store;

namespace {

StoreOptions SegOptions(int dim, int threads) {
  StoreOptions o;
  o.dim = dim;
  o.num_threads = threads;
  o.num_shards = 8;
  o.init.bound = 0.05f;
  o.init.seed = 11;
  o.page_rows = 16;
  o.key_bound = 5000;
  return o;
}

std::vector<float> Rows(EmbeddingStore& s, int64_t lo, int64_t hi) {
  std::vector<int64_t> keys;
  for (int64_t k = lo; k < hi; ++k) keys.push_back(k);
  std::vector<float> out(keys.size() * s.dim());
  s.Lookup(keys.data(), keys.size(), out.data(), false);
  return out;
}

// A gradient value of varied magnitude, so that summing in another order changes the bits.
float Grad(std::mt19937_64& rng) {
  const float mant = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 997.0f;
  static const float kScale[] = {1e-3f, 1.0f, 1e3f, 1e7f};
  return mant * kScale[rng() % 4];
}

}  // namespace

TEST_CASE(store_segments_equal_concatenated_apply_sgd) {
  std::mt19937_64 rng(20240611);
  for (int dim : {3, 16, 32, 64, 128}) {
    for (int threads : {1, 2}) {
      EmbeddingStore seg(SegOptions(dim, threads));
      EmbeddingStore cat(SegOptions(dim, threads));
      for (int round = 0; round < 12; ++round) {
        const size_t nseg = rng() % 9;  // 0..8 segments, some of them empty
        std::vector<std::vector<int64_t>> keys(nseg);
        std::vector<std::vector<float>> grads(nseg);
        std::vector<GradSegment> segs(nseg);
        std::vector<int64_t> all_keys;
        std::vector<float> all_grads;
        for (size_t s = 0; s < nseg; ++s) {
          const size_t n = rng() % 4 == 0 ? 0 : rng() % 300;
          keys[s].resize(n);
          // A small key range: duplicates within and across segments are common.
          for (auto& k : keys[s]) k = static_cast<int64_t>(rng() % 400);
          grads[s].resize(n * dim);
          for (auto& g : grads[s]) g = Grad(rng);
          segs[s] = {keys[s].data(), grads[s].data(), n};
          all_keys.insert(all_keys.end(), keys[s].begin(), keys[s].end());
          all_grads.insert(all_grads.end(), grads[s].begin(), grads[s].end());
        }
        const float lr = 0.01f + static_cast<float>(rng() % 50) / 31.0f;
        const int div = 1 + static_cast<int>(rng() % 3);
        seg.ApplySgdSegments(segs.data(), segs.size(), lr, div);
        cat.ApplySgd(all_keys.data(), all_keys.size(), all_grads.data(), lr, div);
      }
      const auto a = Rows(seg, 0, 400);
      const auto b = Rows(cat, 0, 400);
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      CHECK_EQ(seg.Stats().updates, cat.Stats().updates);
      CHECK_EQ(seg.Size(), cat.Size());
    }
  }
}

TEST_CASE(store_segments_sum_across_segments_in_segment_order) {
  StoreOptions o = SegOptions(1, 1);
  o.init.kind = InitKind::kConstant;
  o.init.value = 1.0f;
  EmbeddingStore s(o);
  const int64_t k = 9;
  const float g0 = 1e8f, g1 = -1e8f, g2 = 1.0f;
  const GradSegment segs[] = {{&k, &g0, 1}, {nullptr, nullptr, 0}, {&k, &g1, 1}, {&k, &g2, 1}};
  s.ApplySgdSegments(segs, 4, 0.5f, 1);
  float out;
  s.Lookup(&k, 1, &out, false);
  float sum = g0;
  sum = sum + g1;
  sum = sum + g2;  // 1e8, -1e8, 1: another order would lose the 1
  CHECK_EQ(out, 1.0f - sum * 0.5f);
  CHECK_EQ(s.Stats().updates, 1);
}

TEST_CASE(store_segments_single_and_empty) {
  EmbeddingStore seg(SegOptions(32, 1));
  EmbeddingStore cat(SegOptions(32, 1));
  seg.ApplySgdSegments(nullptr, 0, 0.1f, 1);
  const GradSegment empty[] = {{nullptr, nullptr, 0}, {nullptr, nullptr, 0}};
  seg.ApplySgdSegments(empty, 2, 0.1f, 1);
  CHECK_EQ(seg.Size(), 0u);
  CHECK_EQ(seg.Stats().updates, 0);
  std::vector<int64_t> keys = {5, 7, 5, 3};
  std::vector<float> grads(keys.size() * 32);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i) * 0.25f - 3.0f;
  const GradSegment one[] = {{nullptr, nullptr, 0}, {keys.data(), grads.data(), keys.size()},
                             {nullptr, nullptr, 0}};
  seg.ApplySgdSegments(one, 3, 0.3f, 2);
  cat.ApplySgd(keys.data(), keys.size(), grads.data(), 0.3f, 2);
  const auto a = Rows(seg, 0, 10);
  const auto b = Rows(cat, 0, 10);
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE(store_segments_bad_input_changes_nothing) {
  EmbeddingStore s(SegOptions(2, 1));
  const int64_t good[] = {1, 2};
  const float rows[] = {1, 2, 3, 4};
  s.Assign(good, 2, rows);
  const int64_t bad[] = {3, 5000};
  const GradSegment segs[] = {{good, rows, 2}, {bad, rows, 2}};
  std::string what;
  try {
    s.ApplySgdSegments(segs, 2, 0.1f, 1);
  } catch (const bagpipe::ValueError& e) {
    what = e.what();
  }
  // The bad key is named at its index in the concatenation (2 + 1).
  CHECK(what.find("key 5000 at index 3") != std::string::npos);
  CHECK_THROWS(bagpipe::ValueError, s.ApplySgdSegments(segs, 1, 0.1f, 0));
  CHECK_THROWS(bagpipe::ValueError, s.ApplySgdSegments(segs, 1, NAN, 1));
  CHECK_EQ(s.Size(), 2u);
  CHECK_EQ(s.Stats().updates, 2);  // the Assign only
  float out[4];
  s.Lookup(good, 2, out, false);
  CHECK(std::memcmp(out, rows, sizeof(rows)) == 0);
}
