#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "store/hash.h"
#include "store/key_map.h"
#include "tests/test_harness.h"

using bagpipe::store::KeyHash;
using bagpipe::store::KeyMap;

// Checks every invariant of KeyMap against an std::unordered_map.
static void CheckAgainst(const KeyMap& map, const std::unordered_map<int64_t, uint32_t>& ref) {
  CHECK_EQ(map.size(), ref.size());
  CHECK(map.size() <= KeyMap::MaxSize(map.capacity()));
  for (const auto& [k, v] : ref) CHECK_EQ(map.Find(k, KeyHash(k)), v);
  size_t stored = 0;
  for (size_t b = 0; b < map.capacity(); ++b) {
    const auto& e = map.entries()[b];
    if (e.tag == 0) continue;
    ++stored;
    // Invariant 2: no empty bucket between the key's home and its position.
    for (size_t i = map.Home(KeyHash(e.key)); i != b; i = (i + 1) % map.capacity()) {
      CHECK(map.entries()[i].tag != 0);
    }
  }
  CHECK_EQ(stored, ref.size());
}

TEST_CASE(store_map_random_insert_erase_matches_reference) {
  for (int shard_bits : {0, 4, 12}) {
    KeyMap map(shard_bits);
    std::unordered_map<int64_t, uint32_t> ref;
    std::mt19937_64 rng(shard_bits + 1);
    uint32_t next = 0;
    for (int step = 0; step < 20000; ++step) {
      // A narrow key range makes long probe runs and wrap-around likely.
      const int64_t key = static_cast<int64_t>(rng() % 3000) - 1500;
      const uint64_t h = KeyHash(key);
      if (rng() % 3 != 0) {
        if (ref.count(key) == 0) {
          map.Insert(key, h, next);
          ref[key] = next++;
        } else {
          CHECK_EQ(map.Find(key, h), ref[key]);
        }
      } else {
        const uint32_t got = map.Erase(key, h);
        auto it = ref.find(key);
        CHECK_EQ(got, it == ref.end() ? KeyMap::kNotFound : it->second);
        if (it != ref.end()) ref.erase(it);
      }
      if (step % 2500 == 0) CheckAgainst(map, ref);
    }
    CheckAgainst(map, ref);
  }
}

TEST_CASE(store_map_extreme_keys_and_set_slot) {
  KeyMap map(4);
  const std::vector<int64_t> keys = {0, -1, INT64_MIN, INT64_MAX, 1, 42};
  for (size_t i = 0; i < keys.size(); ++i) map.Insert(keys[i], KeyHash(keys[i]), KeyMap::kPendingSlot);
  for (size_t i = 0; i < keys.size(); ++i) {
    CHECK_EQ(map.Find(keys[i], KeyHash(keys[i])), KeyMap::kPendingSlot);
    map.SetSlot(keys[i], KeyHash(keys[i]), static_cast<uint32_t>(i));
  }
  for (size_t i = 0; i < keys.size(); ++i) CHECK_EQ(map.Find(keys[i], KeyHash(keys[i])), i);
  CHECK_EQ(map.Find(7, KeyHash(7)), KeyMap::kNotFound);
  CHECK_EQ(map.Erase(7, KeyHash(7)), KeyMap::kNotFound);
}

TEST_CASE(store_map_reserve_and_growth_keep_load_bound) {
  KeyMap map(0);
  CHECK_EQ(map.Find(1, KeyHash(1)), KeyMap::kNotFound);  // empty table
  map.Reserve(1000);
  const size_t cap = map.capacity();
  CHECK(KeyMap::MaxSize(cap) >= 1000);
  CHECK(cap * 7 / 10 < 1000 + 16);  // tight: at most a few buckets over 1000 / 0.7
  for (int64_t k = 0; k < 1000; ++k) map.Insert(k, KeyHash(k), static_cast<uint32_t>(k));
  CHECK_EQ(map.capacity(), cap);  // reserved: no growth
  for (int64_t k = 1000; k < 5000; ++k) map.Insert(k, KeyHash(k), static_cast<uint32_t>(k));
  CHECK(map.size() <= KeyMap::MaxSize(map.capacity()));
  for (int64_t k = 0; k < 5000; ++k) CHECK_EQ(map.Find(k, KeyHash(k)), static_cast<uint32_t>(k));
  map.Clear();
  CHECK_EQ(map.size(), 0u);
  CHECK_EQ(map.Find(3, KeyHash(3)), KeyMap::kNotFound);
}
