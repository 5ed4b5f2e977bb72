#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "store/splitmix64.h"
#include "store/key_map.h"
#include "tests/test_harness.h"

using bagpipe::store::KeyHash;
using bagpipe::store::KeyMap;

// Checks every invariant of KeyMap against an std::unordered_map.
static void CheckAgainst(const KeyMap& map, const std::unordered_map<int64_t, uint32_t>& ref) {
  CHECK_EQ(map.size(), ref.size());
  CHECK(map.size() <= KeyMap::MaxSize(map.capacity()));
  for (const auto& [k, v] : ref) CHECK_EQ(map.Find(k, KeyHash(k)), v);
  CHECK_EQ(map.capacity() % KeyMap::kBucketEntries, 0u);
  auto full = [&](size_t b) {
    for (size_t i = 0; i < KeyMap::kBucketEntries; ++i) {
      if (map.bucket(b)[i].tag == 0) return false;
    }
    return true;
  };
  size_t stored = 0;
  for (size_t i = 0; i < map.capacity(); ++i) {
    const auto& e = map.entries()[i];
    CHECK_EQ(e.reserved, 0u);  // invariant 3
    if (e.tag == 0) {
      CHECK_EQ(e.key, 0);
      continue;
    }
    ++stored;
    // Invariant 2: every bucket from the key's home up to its own is full.
    const size_t p = i / KeyMap::kBucketEntries;
    for (size_t b = map.Home(KeyHash(e.key)); b != p; b = (b + 1) % map.num_buckets()) {
      CHECK(full(b));
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

TEST_CASE(store_map_bucket_match_agrees_with_scalar) {
  alignas(64) KeyMap::Entry bucket[KeyMap::kBucketEntries];
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20000; ++trial) {
    // Small keys (0 included) so hits, empties and key-0 lookups are all frequent.
    for (auto& e : bucket) {
      const bool stored = rng() % 3 != 0;
      e.key = stored ? static_cast<int64_t>(rng() % 5) - 1 : 0;
      e.tag = stored ? static_cast<uint32_t>(rng() % 0xFFFFFFFEu) + 1 : 0;
      e.reserved = 0;
    }
    const int64_t key = static_cast<int64_t>(rng() % 5) - 1;
    const KeyMap::Match a = KeyMap::MatchBucket(bucket, key);
    const KeyMap::Match b = KeyMap::MatchBucketScalar(bucket, key);
    CHECK_EQ(a.hit, b.hit);
    CHECK_EQ(a.empty, b.empty);
    CHECK_EQ(a.hit & ~0x55u, 0u);
    CHECK_EQ(a.empty & ~0x55u, 0u);
    for (unsigned i = 0; i < KeyMap::kBucketEntries; ++i) {
      CHECK_EQ((b.hit >> (2 * i)) & 1, unsigned(bucket[i].tag != 0 && bucket[i].key == key));
      CHECK_EQ((b.empty >> (2 * i)) & 1, unsigned(bucket[i].tag == 0));
      CHECK_EQ(KeyMap::EntryOf(2 * i), i);
    }
  }
}

TEST_CASE(store_map_erase_keeps_full_runs_findable) {
  // Dense clusters: many keys share few home buckets, so erases shift entries across
  // several full buckets (and around the end of the table).
  for (int shard_bits : {0, 3}) {
    KeyMap map(shard_bits);
    map.Reserve(200);
    std::unordered_map<int64_t, uint32_t> ref;
    std::mt19937_64 rng(23 + shard_bits);
    std::vector<int64_t> pool;
    for (int64_t k = 0; pool.size() < 400; ++k) {
      if (map.Home(KeyHash(k)) % 8 < 2 || map.Home(KeyHash(k)) + 2 >= map.num_buckets()) {
        pool.push_back(k);
      }
    }
    uint32_t next = 0;
    for (int step = 0; step < 6000; ++step) {
      const int64_t key = pool[rng() % pool.size()];
      const uint64_t h = KeyHash(key);
      if (ref.count(key) == 0 && ref.size() < 140) {
        map.Insert(key, h, next);
        ref[key] = next++;
      } else if (ref.count(key) != 0) {
        CHECK_EQ(map.Erase(key, h), ref[key]);
        ref.erase(key);
      }
      if (step % 500 == 0) CheckAgainst(map, ref);
    }
    CheckAgainst(map, ref);
  }
}
