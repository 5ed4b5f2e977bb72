// Helpers of the store's chained-checkpoint tests (test_store_checkpoint_chain.cc,
// test_store_snapshot.cc): a small store, random rounds of ops, its contents bit for bit.
#pragma once

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/errors.h"
#include "store/embedding_store.h"
#include "tests/test_harness.h"

namespace bagpipe::testing::store_chain {

using namespace bagpipe::store;

constexpr int kDim = 8;

inline StoreOptions Options(OptimizerKind kind, int shards = 4) {
  StoreOptions o;
  o.dim = kDim;
  o.num_shards = shards;
  o.init.bound = 0.05f;
  o.init.seed = 11;
  o.page_rows = 32;
  o.optimizer.kind = kind;
  return o;
}

// Every stored row: key -> the bits of its weights and state.
using Contents = std::map<int64_t, std::vector<uint32_t>>;

inline Contents ContentsOf(EmbeddingStore& s) {
  Contents c;
  const size_t sd = static_cast<size_t>(s.state_dim());
  std::vector<int64_t> keys(100);
  std::vector<float> rows(100 * kDim), state(100 * std::max<size_t>(sd, 1));
  int64_t cursor = 0;
  while (cursor != -1) {
    const size_t n = s.Export(&cursor, 100, keys.data(), rows.data(), sd ? state.data() : nullptr);
    for (size_t i = 0; i < n; ++i) {
      std::vector<uint32_t> bits(kDim + sd);
      std::memcpy(bits.data(), rows.data() + i * kDim, kDim * 4);
      if (sd) std::memcpy(bits.data() + kDim, state.data() + i * sd, sd * 4);
      CHECK(c.emplace(keys[i], std::move(bits)).second);
    }
  }
  return c;
}

inline std::unique_ptr<EmbeddingStore> LoadDir(const std::string& dir, std::optional<int> links = {},
                                        std::map<std::string, std::string>* meta = nullptr) {
  LoadOverrides ov;
  ov.chain_links = links;
  return EmbeddingStore::Load(dir, ov, meta);
}

// What one round of random ops changed: keys stored or changed, keys erased.
struct Changes {
  std::set<int64_t> touched;
  std::set<int64_t> erased;
};

// A random round touching about `frac` of keys [0, 2000): updates, assigns, inserting reads,
// erases, pure reads.
inline void Mutate(EmbeddingStore& s, std::mt19937_64& rng, double frac, Changes* ch) {
  const size_t n = static_cast<size_t>(2000 * frac) + 1;
  std::vector<int64_t> keys(n);
  for (auto& k : keys) k = static_cast<int64_t>(rng() % 2000);
  std::vector<float> vals(n * kDim);
  for (auto& v : vals) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 977.0f;
  std::vector<float> out(n * kDim);
  switch (rng() % 6) {
    case 0:
    case 1:
      s.ApplyGradients(keys.data(), n, vals.data(), 0.1f, 1);
      ch->touched.insert(keys.begin(), keys.end());
      break;
    case 2:
      s.Assign(keys.data(), n, vals.data());
      ch->touched.insert(keys.begin(), keys.end());
      break;
    case 3: {
      // Only absent keys become stored (changed); the rows read stay clean.
      std::vector<uint8_t> present(n);
      s.Contains(keys.data(), n, present.data());
      s.Lookup(keys.data(), n, out.data(), /*insert_missing=*/true);
      for (size_t i = 0; i < n; ++i) {
        if (!present[i]) ch->touched.insert(keys[i]);
      }
      break;
    }
    case 4: {
      const size_t m = n / 4 + 1;
      s.Erase(keys.data(), m);
      for (size_t i = 0; i < m; ++i) {
        ch->erased.insert(keys[i]);
        ch->touched.erase(keys[i]);
      }
      break;
    }
    default:
      s.Lookup(keys.data(), n, out.data(), /*insert_missing=*/false);
  }
}

inline ChainPolicy Policy(int full_every, double fraction) {
  ChainPolicy p;
  p.full_every = full_every;
  p.chain_fraction = fraction;
  return p;
}

// The message of the ValueError fn throws ("" when none).
inline std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const bagpipe::ValueError& e) {
    return e.what();
  }
  return "";
}

inline bool Contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

inline void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// The names in a directory (none when it cannot be read).
inline std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    names.push_back(e.path().filename().string());
  }
  return names;
}

}  // namespace bagpipe::testing::store_chain
