#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
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

StoreOptions Options(int dim, int threads = 1, int shards = 16) {
  StoreOptions o;
  o.dim = dim;
  o.num_threads = threads;
  o.num_shards = shards;
  o.init.bound = 0.05f;
  o.init.seed = 5;
  o.page_rows = 16;
  return o;
}

// The dict model: stored rows; absent keys read as EmbeddingStore::InitialRows.
struct Model {
  int dim;
  InitSpec init;
  std::map<int64_t, std::vector<float>> rows;

  std::vector<float> Get(int64_t k) const {
    auto it = rows.find(k);
    if (it != rows.end()) return it->second;
    std::vector<float> r(dim);
    EmbeddingStore::InitialRows(init, dim, &k, 1, r.data());
    return r;
  }
};

bool SameBits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

std::vector<float> Snapshot(EmbeddingStore& s, const std::vector<int64_t>& keys) {
  std::vector<float> out(keys.size() * s.dim());
  s.Lookup(keys.data(), keys.size(), out.data(), false);
  return out;
}

// Runs a fixed random op sequence; returns the final rows of keys [-200, 800).
std::vector<float> Workload(const StoreOptions& o, Model* model) {
  EmbeddingStore s(o);
  std::mt19937_64 rng(77);
  const int dim = o.dim;
  for (int step = 0; step < 120; ++step) {
    const size_t n = rng() % 600;
    std::vector<int64_t> keys(n);
    for (auto& k : keys) k = static_cast<int64_t>(rng() % 1000) - 200;
    std::vector<float> vals(n * dim);
    for (auto& v : vals) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 997.0f;
    switch (rng() % 5) {
      case 0: {
        std::vector<float> out(n * dim);
        const bool insert = rng() % 2;
        s.Lookup(keys.data(), n, out.data(), insert);
        if (model) {
          for (size_t i = 0; i < n; ++i) {
            CHECK(SameBits(out.data() + i * dim, model->Get(keys[i]).data(), dim));
            if (insert && !model->rows.count(keys[i])) model->rows[keys[i]] = model->Get(keys[i]);
          }
        }
        break;
      }
      case 1:
        s.Assign(keys.data(), n, vals.data());
        if (model) {
          for (size_t i = 0; i < n; ++i) {
            model->rows[keys[i]].assign(vals.begin() + i * dim, vals.begin() + (i + 1) * dim);
          }
        }
        break;
      case 2: {
        const float lr = 0.1f + static_cast<float>(rng() % 10) / 7.0f;
        const int div = 1 + static_cast<int>(rng() % 3);
        s.ApplySgd(keys.data(), n, vals.data(), lr, div);
        if (model) {
          std::map<int64_t, std::vector<float>> sums;
          for (size_t i = 0; i < n; ++i) {
            auto it = sums.find(keys[i]);
            if (it == sums.end()) {
              sums[keys[i]].assign(vals.begin() + i * dim, vals.begin() + (i + 1) * dim);
            } else {
              for (int c = 0; c < dim; ++c) it->second[c] = it->second[c] + vals[i * dim + c];
            }
          }
          for (auto& [k, g] : sums) {
            std::vector<float> w = model->Get(k);
            for (int c = 0; c < dim; ++c) {
              float u = g[c];
              if (div != 1) u = u / static_cast<float>(div);
              u = u * lr;
              w[c] = w[c] - u;
            }
            model->rows[k] = w;
          }
        }
        break;
      }
      case 3: {
        const size_t erased = s.Erase(keys.data(), n);
        if (model) {
          size_t expect = 0;
          for (int64_t k : keys) expect += model->rows.erase(k);
          CHECK_EQ(erased, expect);
        }
        break;
      }
      default: {
        std::vector<uint8_t> present(n);
        s.Contains(keys.data(), n, present.data());
        if (model) {
          for (size_t i = 0; i < n; ++i) CHECK_EQ(present[i] != 0, model->rows.count(keys[i]) != 0);
        }
      }
    }
    if (model) CHECK_EQ(s.Size(), model->rows.size());
  }
  std::vector<int64_t> all;
  for (int64_t k = -200; k < 800; ++k) all.push_back(k);
  return Snapshot(s, all);
}

}  // namespace

TEST_CASE(store_engine_matches_model) {
  // Dims with a generic and with a specialised row size (16, 32, 128 floats), on one and on
  // two threads (the read pipeline and the SGD kernels are templated on both).
  for (auto [dim, threads] : {std::pair{5, 1}, std::pair{16, 2}, std::pair{32, 1}, std::pair{32, 2},
                              std::pair{128, 2}}) {
    StoreOptions o = Options(dim, threads);
    Model model{dim, o.init, {}};
    const auto final_rows = Workload(o, &model);
    for (int64_t k = -200; k < 800; ++k) {
      CHECK(SameBits(final_rows.data() + (k + 200) * dim, model.Get(k).data(), dim));
    }
  }
}

TEST_CASE(store_engine_bitwise_independent_of_threads_and_shards) {
  const auto ref = Workload(Options(7, 1, 16), nullptr);
  for (auto [threads, shards] : {std::pair{2, 16}, std::pair{2, 1}, std::pair{3, 64}, std::pair{1, 4096}}) {
    const auto got = Workload(Options(7, threads, shards), nullptr);
    CHECK(SameBits(got.data(), ref.data(), ref.size()));
  }
}

TEST_CASE(store_engine_sgd_sums_duplicates_in_input_order) {
  StoreOptions o = Options(3);
  o.init.kind = InitKind::kConstant;
  o.init.value = 1.0f;
  EmbeddingStore s(o);
  const int64_t keys[] = {9, 4, 9, 9};
  const float g[] = {1e8f, 0, 0, 0.3f, 0, 0, -1e8f, 0, 0, 1.0f, 2.0f, 3.0f};
  s.ApplySgd(keys, 4, g, 0.5f, 3);
  float out[3];
  s.Lookup(&keys[0], 1, out, false);
  float sum = 1e8f;
  sum = sum + -1e8f;
  sum = sum + 1.0f;  // input order: 1e8, -1e8, 1 (a different order would lose the 1)
  float u = sum / 3.0f;
  u = u * 0.5f;
  CHECK_EQ(out[0], 1.0f - u);
  float v = 2.0f / 3.0f;
  v = v * 0.5f;
  CHECK_EQ(out[1], 1.0f - v);
  s.Lookup(&keys[1], 1, out, false);
  float u4 = 0.3f / 3.0f;
  u4 = u4 * 0.5f;
  CHECK_EQ(out[0], 1.0f - u4);
  CHECK_EQ(s.Stats().updates, 2);
}

TEST_CASE(store_engine_bad_input_changes_nothing) {
  StoreOptions o = Options(2);
  o.key_bound = 100;
  EmbeddingStore s(o);
  const int64_t good[] = {1, 2};
  const float rows[] = {1, 2, 3, 4};
  s.Assign(good, 2, rows);
  const int64_t bad[] = {3, 100};
  float out[4];
  CHECK_THROWS(bagpipe::ValueError, s.Assign(bad, 2, rows));
  CHECK_THROWS(bagpipe::ValueError, s.ApplySgd(bad, 2, rows, 0.1f, 1));
  CHECK_THROWS(bagpipe::ValueError, s.Lookup(bad, 2, out, true));
  const int64_t neg[] = {-1};
  CHECK_THROWS(bagpipe::ValueError, s.Erase(neg, 1));
  CHECK_THROWS(bagpipe::ValueError, s.ApplySgd(good, 2, rows, 0.1f, 0));
  CHECK_THROWS(bagpipe::ValueError, s.ApplySgd(good, 2, rows, NAN, 1));
  CHECK_EQ(s.Size(), 2u);
  s.Lookup(good, 2, out, false);
  CHECK(SameBits(out, rows, 4));

  for (auto mutate : {+[](StoreOptions& x) { x.dim = 0; }, +[](StoreOptions& x) { x.num_shards = 3; },
                      +[](StoreOptions& x) { x.num_threads = 0; }, +[](StoreOptions& x) { x.page_rows = (1u << 24) + 1; },
                      +[](StoreOptions& x) { x.memory_budget = -2; },
                      +[](StoreOptions& x) { x.low_watermark = 0.9; },
                      +[](StoreOptions& x) { x.init.bound = -1; }}) {
    StoreOptions b = Options(2);
    mutate(b);
    CHECK_THROWS(bagpipe::ValueError, EmbeddingStore{b});
  }
}

TEST_CASE(store_engine_memory_only_budget_refuses_whole_call) {
  StoreOptions o = Options(16);  // stride 64 B, page_rows 64: 4 KiB pages
  o.page_rows = 64;
  o.memory_budget = 4 * 4096;
  EmbeddingStore s(o);
  std::vector<int64_t> keys(256);
  for (int i = 0; i < 256; ++i) keys[i] = i;
  std::vector<float> rows(256 * 16, 1.5f);
  s.Assign(keys.data(), 256, rows.data());  // exactly 4 pages
  CHECK_EQ(s.Stats().pages, 4);
  std::vector<int64_t> more = {1000, 5, 1001};
  std::vector<float> more_rows(3 * 16, 7.0f);
  CHECK_THROWS(bagpipe::MemoryBudgetError, s.Assign(more.data(), 3, more_rows.data()));
  CHECK_THROWS(bagpipe::MemoryBudgetError, s.ApplySgd(more.data(), 3, more_rows.data(), 1.0f, 1));
  std::vector<float> out(3 * 16);
  CHECK_THROWS(bagpipe::MemoryBudgetError, s.Lookup(more.data(), 3, out.data(), true));
  CHECK_EQ(s.Size(), 256u);
  uint8_t present[3];
  s.Contains(more.data(), 3, present);
  CHECK(!present[0] && present[1] && !present[2]);
  std::vector<float> check(16);
  s.Lookup(&keys[5], 1, check.data(), false);
  CHECK(SameBits(check.data(), rows.data(), 16));  // key 5 not updated by the failed SGD
  // Erasing makes room: freed slots are reused without new pages.
  s.Erase(keys.data(), 2);
  s.Assign(more.data(), 1, more_rows.data());
  CHECK_EQ(s.Stats().pages, 4);
}

TEST_CASE(store_engine_export_is_complete_and_invalidated_by_mutation) {
  EmbeddingStore s(Options(3, 2, 4));
  std::vector<int64_t> keys(500);
  for (int i = 0; i < 500; ++i) keys[i] = i * 1000003LL;
  std::vector<float> rows(500 * 3);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  s.Assign(keys.data(), 500, rows.data());
  std::map<int64_t, std::vector<float>> seen;
  int64_t cursor = 0;
  std::vector<int64_t> k(37);
  std::vector<float> r(37 * 3);
  while (cursor != -1) {
    const size_t n = s.Export(&cursor, 37, k.data(), r.data());
    for (size_t i = 0; i < n; ++i) {
      CHECK(seen.count(k[i]) == 0);
      seen[k[i]].assign(r.begin() + i * 3, r.begin() + (i + 1) * 3);
    }
  }
  CHECK_EQ(seen.size(), 500u);
  for (int i = 0; i < 500; ++i) CHECK(SameBits(seen[keys[i]].data(), rows.data() + i * 3, 3));
  cursor = 0;
  s.Export(&cursor, 10, k.data(), r.data());
  s.Erase(keys.data(), 1);
  CHECK_THROWS(bagpipe::ValueError, s.Export(&cursor, 10, k.data(), r.data()));
  int64_t done = -1;
  CHECK_THROWS(bagpipe::ValueError, s.Export(&done, 10, k.data(), r.data()));
}

TEST_CASE(store_engine_spill_mode_preserves_values) {
  TempDir dir;
  StoreOptions o = Options(16, 2, 8);
  o.page_rows = 64;              // 4 KiB pages
  o.memory_budget = 6 * 4096;
  o.spill_dir = dir.path + "/spill";
  Model model{16, o.init, {}};
  EmbeddingStore s(o);
  int warnings = 0;
  s.SetSpillCallback([&](const std::string&) { ++warnings; });
  std::mt19937_64 rng(3);
  for (int step = 0; step < 60; ++step) {
    std::vector<int64_t> keys(200);
    for (auto& k : keys) k = static_cast<int64_t>(rng() % 3000);
    std::vector<float> g(200 * 16, 0.25f);
    s.ApplySgd(keys.data(), keys.size(), g.data(), 0.5f, 1);
    std::map<int64_t, int> count;
    for (int64_t k : keys) ++count[k];
    for (auto& [k, c] : count) {
      float sum = 0.25f;
      for (int i = 1; i < c; ++i) sum = sum + 0.25f;
      const float u = sum * 0.5f;
      std::vector<float> w = model.Get(k);
      for (float& x : w) x = x - u;
      model.rows[k] = w;
    }
    const StoreStats st = s.Stats();
    CHECK(st.bytes_resident - st.bytes_maps <= o.memory_budget);
  }
  CHECK_EQ(warnings, 1);
  const StoreStats st = s.Stats();
  CHECK(st.pages_spilled > 0);
  CHECK(st.swap_outs > 0);
  CHECK_EQ(st.bytes_spilled, st.pages_spilled * st.page_bytes);
  std::vector<int64_t> all;
  for (auto& [k, _] : model.rows) all.push_back(k);
  const auto got = Snapshot(s, all);
  for (size_t i = 0; i < all.size(); ++i) CHECK(SameBits(got.data() + i * 16, model.rows[all[i]].data(), 16));
}

TEST_CASE(store_engine_checkpoint_round_trip_and_refusals) {
  TempDir dir;
  StoreOptions o = Options(4, 2, 4);
  EmbeddingStore s(o);
  std::vector<int64_t> keys(300);
  std::vector<float> rows(300 * 4);
  for (int i = 0; i < 300; ++i) keys[i] = i * 7 - 100;
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i) * 0.5f;
  s.Assign(keys.data(), 300, rows.data());
  const std::string path = dir.path + "/ck";
  s.Save(path, {{"committed_step", "9"}}, false);
  s.Save(path, {{"committed_step", "10"}}, false);  // replaces atomically
  LoadOverrides ov;
  ov.num_shards = 32;
  std::map<std::string, std::string> meta;
  auto t = EmbeddingStore::Load(path, ov, &meta);
  CHECK_EQ(meta["committed_step"], std::string("10"));
  CHECK_EQ(t->Size(), 300u);
  CHECK_EQ(t->options().num_shards, 32);
  CHECK(SameBits(Snapshot(*t, keys).data(), rows.data(), rows.size()));
  CHECK_EQ(EmbeddingStore::ReadCheckpointMeta(path)["committed_step"], std::string("10"));

  LoadOverrides wrong_dim;
  wrong_dim.dim = 5;
  CHECK_THROWS(bagpipe::ValueError, EmbeddingStore::Load(path, wrong_dim, nullptr));
  LoadOverrides wrong_init;
  wrong_init.init = o.init;
  wrong_init.init->seed = 6;
  CHECK_THROWS(bagpipe::ValueError, EmbeddingStore::Load(path, wrong_init, nullptr));

  // Truncate one data file: the load is refused.
  const std::string victim = path + "/rows-0001.bin";
  struct stat st;
  CHECK(stat(victim.c_str(), &st) == 0);
  CHECK(truncate(victim.c_str(), st.st_size - 1) == 0);
  CHECK_THROWS(bagpipe::ValueError, EmbeddingStore::Load(path, {}, nullptr));
  CHECK_THROWS(bagpipe::ValueError, EmbeddingStore::Load(dir.path + "/none", {}, nullptr));
  // A directory with foreign files is never replaced.
  const std::string foreign = dir.path + "/foreign";
  CHECK(mkdir(foreign.c_str(), 0755) == 0);
  const int fd = open((foreign + "/x").c_str(), O_CREAT | O_WRONLY, 0644);
  close(fd);
  CHECK_THROWS(bagpipe::ValueError, s.Save(foreign, {}, false));
}
