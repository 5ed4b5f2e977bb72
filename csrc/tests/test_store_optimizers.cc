// EmbeddingStore optimizers, the store-side mechanics: every kind is bitwise independent of
// thread and shard count, the segment form equals the concatenated call, the state follows
// its row through Assign / Lookup / Export / erase / spill / checkpoints, and bad input
// changes nothing. (The arithmetic itself is proven against a numpy reference in
// tests/test_store_optimizers.py.)
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/errors.h"
#include "store/embedding_store.h"
#include "tests/temp_dir.h"
#include "tests/test_harness.h"

using namespace bagpipe::store;
using bagpipe::testing::TempDir;

namespace {

constexpr OptimizerKind kAllKinds[] = {OptimizerKind::kSgd, OptimizerKind::kAdagrad,
                                       OptimizerKind::kRowWiseAdagrad, OptimizerKind::kAdam};

OptimizerSpec Spec(OptimizerKind kind, double wd = 0.0) {
  OptimizerSpec o;
  o.kind = kind;
  o.eps = 1e-6;
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  o.weight_decay = wd;
  o.initial_accumulator_value = 0.25;
  return o;
}

StoreOptions Options(int dim, const OptimizerSpec& spec, int threads = 1, int shards = 8) {
  StoreOptions o;
  o.dim = dim;
  o.num_threads = threads;
  o.num_shards = shards;
  o.init.bound = 0.05f;
  o.init.seed = 9;
  o.page_rows = 16;
  o.optimizer = spec;
  return o;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Rows and state of keys [lo, hi), read without inserting.
std::pair<std::vector<float>, std::vector<float>> Read(EmbeddingStore& s, int64_t lo, int64_t hi) {
  std::vector<int64_t> keys;
  for (int64_t k = lo; k < hi; ++k) keys.push_back(k);
  std::vector<float> rows(keys.size() * s.dim());
  std::vector<float> state(keys.size() * s.state_dim());
  s.Lookup(keys.data(), keys.size(), rows.data(), state.data(), false);
  return {rows, state};
}

float Grad(std::mt19937_64& rng) {
  const float mant = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 997.0f;
  static const float kScale[] = {1e-3f, 1.0f, 1e3f, 1e-20f};
  return mant * kScale[rng() % 4];
}

// A fixed random sequence of updates, assigns and erases over keys [0, 600).
void Workload(EmbeddingStore& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int dim = s.dim();
  for (int step = 0; step < 40; ++step) {
    const size_t n = rng() % 700;
    std::vector<int64_t> keys(n);
    for (auto& k : keys) k = static_cast<int64_t>(rng() % 600);
    std::vector<float> grads(n * dim);
    for (auto& g : grads) g = Grad(rng);
    const float lr = 0.01f + static_cast<float>(rng() % 10) / 13.0f;
    s.ApplyGradients(keys.data(), n, grads.data(), lr, 1 + static_cast<int>(rng() % 3));
    if (step % 9 == 4) {
      std::vector<int64_t> gone(40);
      for (auto& k : gone) k = static_cast<int64_t>(rng() % 600);
      s.Erase(gone.data(), gone.size());
    }
    if (step % 7 == 3) {
      std::vector<int64_t> set(30);
      for (auto& k : set) k = static_cast<int64_t>(rng() % 600);
      std::vector<float> rows(set.size() * dim, 0.5f);
      s.Assign(set.data(), set.size(), rows.data());
    }
  }
}

}  // namespace

TEST_CASE(store_optimizers_state_dims_and_layout) {
  for (int dim : {1, 3, 16, 32, 100, 128}) {
    for (OptimizerKind kind : kAllKinds) {
      EmbeddingStore s(Options(dim, Spec(kind)));
      CHECK_EQ(s.state_dim(), StateDim(kind, dim));
      const StoreStats st = s.Stats();
      const int64_t row = (dim * 4 + 63) / 64 * 64;
      CHECK_EQ(st.state_dim, s.state_dim());
      CHECK(st.slot_bytes >= row + 4 * s.state_dim());
      if (kind == OptimizerKind::kSgd) CHECK_EQ(st.slot_bytes, row);  // today's bytes per row
      if (kind == OptimizerKind::kRowWiseAdagrad) CHECK_EQ(st.slot_bytes, row + 4);
    }
  }
}

TEST_CASE(store_optimizers_bitwise_independent_of_threads_and_shards) {
  for (OptimizerKind kind : kAllKinds) {
    for (int dim : {5, 32}) {
      const OptimizerSpec spec = Spec(kind, kind == OptimizerKind::kAdam ? 0.01 : 0.0);
      EmbeddingStore ref(Options(dim, spec, 1, 16));
      Workload(ref, 42);
      const auto want = Read(ref, 0, 600);
      for (auto [threads, shards] : {std::pair{2, 16}, std::pair{2, 1}, std::pair{1, 256}}) {
        EmbeddingStore s(Options(dim, spec, threads, shards));
        Workload(s, 42);
        const auto got = Read(s, 0, 600);
        CHECK(SameBits(got.first, want.first));
        CHECK(SameBits(got.second, want.second));
      }
    }
  }
}

TEST_CASE(store_optimizers_any_page_rows_give_the_same_rows) {
  // Automatic page rows of a stateful store are not a power of two (2 MiB / slot bytes);
  // every page geometry, spilled or not, holds the same rows and state.
  for (OptimizerKind kind : {OptimizerKind::kRowWiseAdagrad, OptimizerKind::kAdam}) {
    StoreOptions o = Options(5, Spec(kind), 2);
    o.page_rows = 0;
    EmbeddingStore automatic(o);
    CHECK(automatic.options().page_rows == 2u * 1024 * 1024 / automatic.Stats().slot_bytes);
    CHECK(automatic.Stats().page_bytes == 2 * 1024 * 1024);
    Workload(automatic, 11);
    const auto want = Read(automatic, 0, 600);
    TempDir dir;
    for (uint32_t rows : {1u, 3u, 13u, 16u, 100u}) {
      o.page_rows = rows;
      o.memory_budget = 64 * 4096;
      o.spill_dir = dir.path + "/spill-" + std::to_string(rows);
      EmbeddingStore s(o);
      Workload(s, 11);
      const auto got = Read(s, 0, 600);
      CHECK(SameBits(got.first, want.first));
      CHECK(SameBits(got.second, want.second));
    }
  }
}

TEST_CASE(store_optimizers_segments_equal_concatenated_call) {
  std::mt19937_64 rng(7);
  for (OptimizerKind kind : kAllKinds) {
    for (int dim : {3, 16, 32, 64, 128}) {
      EmbeddingStore seg(Options(dim, Spec(kind, 0.001), 2));
      EmbeddingStore cat(Options(dim, Spec(kind, 0.001), 2));
      for (int round = 0; round < 6; ++round) {
        const size_t nseg = 1 + rng() % 5;
        std::vector<std::vector<int64_t>> keys(nseg);
        std::vector<std::vector<float>> grads(nseg);
        std::vector<GradSegment> segs(nseg);
        std::vector<int64_t> all_keys;
        std::vector<float> all_grads;
        for (size_t i = 0; i < nseg; ++i) {
          const size_t n = rng() % 300;
          for (size_t j = 0; j < n; ++j) keys[i].push_back(static_cast<int64_t>(rng() % 400));
          for (size_t j = 0; j < n * dim; ++j) grads[i].push_back(Grad(rng));
          segs[i] = {keys[i].data(), grads[i].data(), n};
          all_keys.insert(all_keys.end(), keys[i].begin(), keys[i].end());
          all_grads.insert(all_grads.end(), grads[i].begin(), grads[i].end());
        }
        seg.ApplyGradientsSegments(segs.data(), nseg, 0.3f, 2);
        cat.ApplyGradients(all_keys.data(), all_keys.size(), all_grads.data(), 0.3f, 2);
      }
      const auto a = Read(seg, 0, 400), b = Read(cat, 0, 400);
      CHECK(SameBits(a.first, b.first));
      CHECK(SameBits(a.second, b.second));
    }
  }
}

TEST_CASE(store_optimizers_state_follows_assign_lookup_export_and_erase) {
  const int dim = 4;
  EmbeddingStore s(Options(dim, Spec(OptimizerKind::kAdam)));
  const int sd = s.state_dim();
  CHECK_EQ(sd, 8);
  const int64_t keys[3] = {10, 11, 10};
  std::vector<float> rows(3 * dim), state(3 * sd);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  for (size_t i = 0; i < state.size(); ++i) state[i] = 100.0f + static_cast<float>(i);
  s.Assign(keys, 3, rows.data(), state.data());  // key 10: the last occurrence wins
  std::vector<float> out(2 * dim), out_state(2 * sd);
  const int64_t probe[2] = {10, 11};
  s.Lookup(probe, 2, out.data(), out_state.data(), false);
  CHECK(std::memcmp(out.data(), rows.data() + 2 * dim, dim * 4) == 0);
  CHECK(std::memcmp(out_state.data(), state.data() + 2 * sd, sd * 4) == 0);
  CHECK(std::memcmp(out_state.data() + sd, state.data() + sd, sd * 4) == 0);

  // Weights-only assign: a stored row keeps its state, a new row starts from the initial one.
  const int64_t again[2] = {11, 12};
  std::vector<float> ones(2 * dim, 1.0f);
  s.Assign(again, 2, ones.data());
  s.Lookup(again, 2, out.data(), out_state.data(), false);
  CHECK(std::memcmp(out_state.data(), state.data() + sd, sd * 4) == 0);
  for (int c = 0; c < sd; ++c) CHECK_EQ(out_state[sd + c], 0.0f);

  // Export with state: every stored key once, with its state.
  std::map<int64_t, std::vector<float>> seen;
  int64_t cursor = 0;
  std::vector<int64_t> ek(2);
  std::vector<float> er(2 * dim), es(2 * sd);
  while (cursor != -1) {
    const size_t n = s.Export(&cursor, 2, ek.data(), er.data(), es.data());
    for (size_t i = 0; i < n; ++i) seen[ek[i]].assign(es.begin() + i * sd, es.begin() + (i + 1) * sd);
  }
  CHECK_EQ(seen.size(), 3u);
  CHECK(std::memcmp(seen[10].data(), state.data() + 2 * sd, sd * 4) == 0);

  // An erased and reinserted key starts over: initial row and initial state.
  CHECK_EQ(s.Erase(probe, 1), 1u);
  std::vector<float> fresh(dim), fresh_state(sd, -1.0f), init(dim), init_state(sd);
  s.Lookup(probe, 1, fresh.data(), fresh_state.data(), true);
  EmbeddingStore::InitialRows(s.options().init, dim, s.options().optimizer, probe, 1, init.data(),
                              init_state.data());
  CHECK(SameBits(fresh, init));
  CHECK(SameBits(fresh_state, init_state));
}

TEST_CASE(store_optimizers_initial_state_values) {
  for (OptimizerKind kind : kAllKinds) {
    EmbeddingStore s(Options(6, Spec(kind)));
    const int64_t k = 77;
    std::vector<float> row(6), st(s.state_dim() + 1, -1.0f);
    s.Lookup(&k, 1, row.data(), st.data(), false);
    const bool adagrad = kind == OptimizerKind::kAdagrad || kind == OptimizerKind::kRowWiseAdagrad;
    for (int c = 0; c < s.state_dim(); ++c) CHECK_EQ(st[c], adagrad ? 0.25f : 0.0f);
    CHECK_EQ(st[s.state_dim()], -1.0f);  // nothing written past the state
  }
}

TEST_CASE(store_optimizers_nan_gradient_stays_in_its_row) {
  for (OptimizerKind kind : kAllKinds) {
    const int dim = 8;
    EmbeddingStore s(Options(dim, Spec(kind)));
    EmbeddingStore clean(Options(dim, Spec(kind)));
    std::vector<int64_t> keys = {1, 2, 3, 2};
    std::vector<float> g(keys.size() * dim, 0.5f);
    g[1 * dim + 3] = NAN;  // key 2's first occurrence
    g[2 * dim + 0] = INFINITY;
    s.ApplyGradients(keys.data(), keys.size(), g.data(), 0.1f, 1);
    std::vector<int64_t> ok = {1};
    std::vector<float> og(dim, 0.5f);
    clean.ApplyGradients(ok.data(), 1, og.data(), 0.1f, 1);
    const auto a = Read(s, 1, 2), b = Read(clean, 1, 2);
    CHECK(SameBits(a.first, b.first));
    CHECK(SameBits(a.second, b.second));
    const auto bad = Read(s, 2, 3);
    bool any_nan = false;
    for (float v : bad.first) any_nan |= std::isnan(v);
    CHECK(any_nan);
  }
}

TEST_CASE(store_optimizers_apply_sgd_refuses_stateful_stores) {
  EmbeddingStore s(Options(4, Spec(OptimizerKind::kAdagrad)));
  const int64_t k[1] = {1};
  const float g[4] = {1, 1, 1, 1};
  bool threw = false;
  try {
    s.ApplySgd(k, 1, g, 0.1f, 1);
  } catch (const bagpipe::ValueError& e) {
    threw = std::string(e.what()).find("optimizer") != std::string::npos;
  }
  CHECK(threw);
  const GradSegment seg{k, g, 1};
  CHECK_THROWS(bagpipe::ValueError, s.ApplySgdSegments(&seg, 1, 0.1f, 1));
  CHECK_EQ(s.Size(), 0u);
  CHECK_THROWS(bagpipe::ValueError, s.ApplyGradients(k, 1, g, NAN, 1));
  CHECK_THROWS(bagpipe::ValueError, s.ApplyGradients(k, 1, g, 0.1f, 0));
  CHECK_EQ(s.Size(), 0u);
}

TEST_CASE(store_optimizers_bad_specs_name_the_field) {
  auto error_of = [](const OptimizerSpec& spec) -> std::string {
    try {
      EmbeddingStore s(Options(4, spec));
    } catch (const bagpipe::ValueError& e) {
      return e.what();
    }
    return "";
  };
  OptimizerSpec o = Spec(OptimizerKind::kAdam);
  o.eps = -1e-8;
  CHECK(error_of(o).find("optimizer.eps") != std::string::npos);
  o = Spec(OptimizerKind::kAdam);
  o.eps = 1e39;  // finite as a double, inf as float32
  CHECK(error_of(o).find("optimizer.eps") != std::string::npos);
  o = Spec(OptimizerKind::kAdam);
  o.beta1 = 1.0;
  CHECK(error_of(o).find("optimizer.beta1") != std::string::npos);
  o = Spec(OptimizerKind::kAdam);
  o.beta2 = NAN;
  CHECK(error_of(o).find("optimizer.beta2") != std::string::npos);
  o = Spec(OptimizerKind::kSgd);
  o.weight_decay = INFINITY;
  CHECK(error_of(o).find("optimizer.weight_decay") != std::string::npos);
  o = Spec(OptimizerKind::kAdagrad);
  o.initial_accumulator_value = -1;
  CHECK(error_of(o).find("optimizer.initial_accumulator_value") != std::string::npos);
  o = Spec(OptimizerKind::kSgd);
  o.kind = static_cast<OptimizerKind>(9);
  CHECK(error_of(o).find("optimizer.kind") != std::string::npos);
  CHECK_THROWS(bagpipe::ValueError, ParseOptimizerKind("lamb"));
  CHECK(ParseOptimizerKind("rowwise_adagrad") == OptimizerKind::kRowWiseAdagrad);
}

TEST_CASE(store_optimizers_state_survives_spill_and_checkpoint) {
  TempDir dir;
  for (OptimizerKind kind : kAllKinds) {
    const int dim = 16;
    StoreOptions o = Options(dim, Spec(kind, 0.0), 2);
    EmbeddingStore plain(o);
    o.memory_budget = 3 * 4096 * 4;  // a few pages: the workload spills
    o.spill_dir = dir.path + "/spill";
    EmbeddingStore spilled(o);
    Workload(plain, 5);
    Workload(spilled, 5);
    CHECK(spilled.Stats().pages_spilled > 0);
    const auto want = Read(plain, 0, 600);
    const auto got = Read(spilled, 0, 600);
    CHECK(SameBits(got.first, want.first));
    CHECK(SameBits(got.second, want.second));

    const std::string ck = dir.path + "/ck-" + OptimizerKindName(kind);
    spilled.Save(ck, {{"step", "3"}}, false);
    LoadOverrides ov;
    ov.num_shards = 4;
    auto loaded = EmbeddingStore::Load(ck, ov, nullptr);
    CHECK(loaded->options().optimizer == o.optimizer);
    const auto back = Read(*loaded, 0, 600);
    CHECK(SameBits(back.first, want.first));
    CHECK(SameBits(back.second, want.second));
    // The loaded store continues exactly as the original.
    std::vector<int64_t> k = {1, 2, 3, 1};
    std::vector<float> g(4 * dim, 0.125f);
    loaded->ApplyGradients(k.data(), 4, g.data(), 0.5f, 2);
    plain.ApplyGradients(k.data(), 4, g.data(), 0.5f, 2);
    const auto after_a = Read(*loaded, 0, 10), after_b = Read(plain, 0, 10);
    CHECK(SameBits(after_a.first, after_b.first));
    CHECK(SameBits(after_a.second, after_b.second));
  }
}

TEST_CASE(store_optimizers_load_checks_the_optimizer) {
  TempDir dir;
  const int dim = 4;
  EmbeddingStore s(Options(dim, Spec(OptimizerKind::kAdagrad)));
  std::vector<int64_t> k = {1, 2};
  std::vector<float> g(2 * dim, 1.0f);
  s.ApplyGradients(k.data(), 2, g.data(), 0.1f, 1);
  const std::string ck = dir.path + "/ck";
  s.Save(ck, {}, false);
  auto error_of = [&](const LoadOverrides& ov) -> std::string {
    try {
      EmbeddingStore::Load(ck, ov, nullptr);
    } catch (const bagpipe::ValueError& e) {
      return e.what();
    }
    return "";
  };
  LoadOverrides ov;
  ov.optimizer = Spec(OptimizerKind::kRowWiseAdagrad);
  CHECK(error_of(ov).find("optimizer.kind") != std::string::npos);
  ov.optimizer = Spec(OptimizerKind::kAdagrad);
  ov.optimizer->eps = 1e-7;
  CHECK(error_of(ov).find("optimizer.eps") != std::string::npos);
  ov.optimizer = Spec(OptimizerKind::kAdagrad);
  ov.optimizer->initial_accumulator_value = 0.5;
  CHECK(error_of(ov).find("optimizer.initial_accumulator_value") != std::string::npos);
  ov.optimizer = Spec(OptimizerKind::kAdagrad);
  ov.optimizer->beta1 = 0.5;  // Adagrad does not use beta1: the same update
  CHECK_EQ(error_of(ov), std::string());

  // weights_only may change the optimizer: weights kept, state initial.
  ov.optimizer = Spec(OptimizerKind::kAdam);
  ov.weights_only = true;
  auto adam = EmbeddingStore::Load(ck, ov, nullptr);
  CHECK(adam->options().optimizer.kind == OptimizerKind::kAdam);
  const auto a = Read(*adam, 1, 3), b = Read(s, 1, 3);
  CHECK(SameBits(a.first, b.first));
  for (float v : a.second) CHECK_EQ(v, 0.0f);

  // A weights-only checkpoint records the optimizer; loading it gives the initial state.
  s.Save(ck, {}, true);
  auto w = EmbeddingStore::Load(ck, LoadOverrides{}, nullptr);
  CHECK(w->options().optimizer == s.options().optimizer);
  const auto c = Read(*w, 1, 3);
  CHECK(SameBits(c.first, b.first));
  for (float v : c.second) CHECK_EQ(v, 0.25f);
}
