#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "cache/cache_metadata.h"
#include "common/errors.h"
#include "tests/test_harness.h"

using bagpipe::cache::CacheMetadata;
using bagpipe::cache::EvictionPolicy;
using bagpipe::cache::kNever;
using bagpipe::cache::SlotState;

namespace {

std::vector<int64_t> Iota(int64_t from, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = from + i;
  return v;
}

std::vector<int64_t> Fill(size_t n, int64_t value) { return std::vector<int64_t>(n, value); }

// Checks invariants 1 and 2: the map and the slot table agree, capacity holds.
void CheckConsistent(const CacheMetadata& m) {
  std::set<int64_t> keys;
  int64_t resident = 0;
  for (int64_t s = 0; s < m.capacity_rows(); ++s) {
    auto v = m.Slot(s);
    if (v.state == SlotState::kFree) continue;
    ++resident;
    CHECK(keys.insert(v.key).second);
    int64_t found = -2;
    m.Lookup(&v.key, 1, &found);
    CHECK_EQ(found, s);
  }
  CHECK_EQ(resident, m.size());
  CHECK(resident <= m.capacity_rows());
}

}  // namespace

TEST_CASE(cache_metadata_rejects_bad_capacity_and_policy) {
  CHECK_THROWS(bagpipe::ValueError, (CacheMetadata{0, EvictionPolicy::kLru}));
  CHECK_THROWS(bagpipe::ValueError, bagpipe::cache::ParseEvictionPolicy("fifo"));
  CacheMetadata m(2, EvictionPolicy::kOracle);
  CHECK_EQ(m.capacity_rows(), 128);
}

TEST_CASE(cache_metadata_admit_fills_free_slots_in_order_and_bounds_oversized_batches) {
  CacheMetadata m(1, EvictionPolicy::kLru);
  m.Advance(0);
  auto keys = Iota(1000, 100);  // larger than the 64-row cache
  auto r = m.Admit(keys.data(), Fill(100, -1).data(), Fill(100, -1).data(), keys.size());
  CHECK_EQ(r.slots.size(), 64u);
  CHECK_EQ(r.bypassed.size(), 36u);
  CHECK(r.evicted_keys.empty());  // this step's rows are pinned: no slot is handed out twice
  std::set<int64_t> uniq(r.slots.begin(), r.slots.end());
  CHECK_EQ(uniq.size(), 64u);
  for (size_t i = 0; i < 64; ++i) {
    CHECK_EQ(r.pos[i], static_cast<int64_t>(i));
    CHECK_EQ(r.slots[i], static_cast<int64_t>(i));
  }
  CheckConsistent(m);
  // Next step: the pins expired, LRU evicts the oldest first.
  m.Advance(1);
  auto more = Iota(5000, 3);
  auto r2 = m.Admit(more.data(), Fill(3, 0).data(), Fill(3, -1).data(), 3);
  CHECK_EQ(r2.evicted_keys.size(), 3u);
  CHECK_EQ(r2.evicted_keys[0], 1000);
  CHECK_EQ(r2.evicted_keys[2], 1002);
  CheckConsistent(m);
}

TEST_CASE(cache_metadata_admit_rejects_duplicates_and_resident_keys_without_change) {
  CacheMetadata m(1, EvictionPolicy::kLru);
  m.Advance(0);
  std::vector<int64_t> k = {5, 6};
  m.Admit(k.data(), Fill(2, -1).data(), Fill(2, -1).data(), 2);
  std::vector<int64_t> dup = {7, 7};
  CHECK_THROWS(bagpipe::ValueError, m.Admit(dup.data(), Fill(2, -1).data(), Fill(2, -1).data(), 2));
  std::vector<int64_t> res = {8, 5};
  CHECK_THROWS(bagpipe::ValueError, m.Admit(res.data(), Fill(2, -1).data(), Fill(2, -1).data(), 2));
  std::vector<int64_t> neg = {-3};
  CHECK_THROWS(bagpipe::ValueError, m.Admit(neg.data(), Fill(1, -1).data(), Fill(1, -1).data(), 1));
  CHECK_EQ(m.size(), 2);
  int64_t slot = 0;
  int64_t eight = 8;
  m.Lookup(&eight, 1, &slot);
  CHECK_EQ(slot, -1);
}

TEST_CASE(cache_metadata_lru_touch_changes_the_victim) {
  CacheMetadata m(1, EvictionPolicy::kLru);
  m.Advance(0);
  auto keys = Iota(0, 64);
  m.Admit(keys.data(), Fill(64, -1).data(), Fill(64, -1).data(), 64);
  m.Advance(1);
  std::vector<int64_t> touch = {0};
  int64_t v = -1, nu = -1;
  auto q = m.Query(touch.data(), &v, &nu, 1);
  CHECK_EQ(q.hit_slots.size(), 1u);
  auto order = m.VictimOrder();
  CHECK_EQ(order.front(), 1);  // key 0 became most recent
  CHECK_EQ(order.back(), 0);
}

TEST_CASE(cache_metadata_oracle_evicts_furthest_next_use_and_bypasses_later_candidates) {
  CacheMetadata m(1, EvictionPolicy::kOracle);
  m.Advance(0);
  auto keys = Iota(0, 64);
  std::vector<int64_t> nu(64);
  for (int64_t i = 0; i < 64; ++i) nu[static_cast<size_t>(i)] = i < 32 ? 2 + i : -1;  // half: kNever
  m.Admit(keys.data(), Fill(64, -1).data(), nu.data(), 64);
  m.Advance(1);
  // A candidate next used at step 5: evicts a kNever row first (oldest of them: key 32).
  int64_t k = 100, v = -1, use = 5;
  auto r = m.Admit(&k, &v, &use, 1);
  CHECK_EQ(r.evicted_keys.size(), 1u);
  CHECK_EQ(r.evicted_keys[0], 32);
  // Evict all kNever rows, then the furthest finite one (key 31, next use 33).
  std::vector<int64_t> many = Iota(200, 31);
  std::vector<int64_t> uses(31, 3);
  m.Admit(many.data(), Fill(31, -1).data(), uses.data(), 31);
  m.Advance(2);  // key 0's next use (2) is now past: it joins the kNever victims
  int64_t k2 = 300, u2 = 4;
  auto r2 = m.Admit(&k2, &v, &u2, 1);
  CHECK_EQ(r2.evicted_keys.size(), 1u);
  CHECK_EQ(r2.evicted_keys[0], 0);
  int64_t k2b = 302;
  auto r2b = m.Admit(&k2b, &v, &u2, 1);
  CHECK_EQ(r2b.evicted_keys.size(), 1u);
  CHECK_EQ(r2b.evicted_keys[0], 31);
  // A candidate used later than every victim is bypassed (Belady with bypass).
  int64_t k3 = 301, u3 = 1000;
  auto r3 = m.Admit(&k3, &v, &u3, 1);
  CHECK(r3.slots.empty());
  CHECK_EQ(r3.bypassed.size(), 1u);
  CheckConsistent(m);
}

TEST_CASE(cache_metadata_oracle_falls_back_to_lru_among_unknown_next_uses) {
  CacheMetadata m(1, EvictionPolicy::kOracle);
  m.Advance(0);
  auto keys = Iota(0, 64);
  std::vector<int64_t> nu(64, -1);
  nu[0] = 9;  // key 0 is needed again; every other row has no known next use
  m.Admit(keys.data(), Fill(64, -1).data(), nu.data(), 64);
  m.Advance(1);
  // A row with no known next use replaces the least recently used unknown row (key 1) ...
  int64_t k = 100, v = -1, none = -1;
  auto r = m.Admit(&k, &v, &none, 1);
  CHECK_EQ(r.evicted_keys.size(), 1u);
  CHECK_EQ(r.evicted_keys[0], 1);
  // ... and once only rows with a known next use are left, it is bypassed.
  std::vector<int64_t> soon = Iota(200, 63);
  m.Advance(2);
  auto r2 = m.Admit(soon.data(), Fill(63, -1).data(), Fill(63, 5).data(), 63);
  CHECK_EQ(r2.evicted_keys.size(), 63u);  // the 63 unknown rows (key 100 last)
  CHECK_EQ(r2.evicted_keys.back(), 100);
  m.Advance(3);
  int64_t k2 = 300;
  auto r3 = m.Admit(&k2, &v, &none, 1);
  CHECK(r3.slots.empty());
  CHECK_EQ(r3.bypassed.size(), 1u);
  CheckConsistent(m);
}

TEST_CASE(cache_metadata_advance_turns_past_next_uses_into_never) {
  CacheMetadata m(1, EvictionPolicy::kOracle);
  m.Advance(0);
  std::vector<int64_t> keys = {1, 2};
  std::vector<int64_t> nu = {3, 9};
  m.Admit(keys.data(), Fill(2, -1).data(), nu.data(), 2);
  m.Advance(5);  // key 1's next use (3) has passed without a read
  CHECK_EQ(m.Slot(0).next_use, kNever);
  CHECK_EQ(m.Slot(1).next_use, 9);
  auto order = m.VictimOrder();
  CHECK_EQ(order.front(), 0);
  CHECK_THROWS(bagpipe::ValueError, m.Advance(4));
}

TEST_CASE(cache_metadata_query_drops_stale_rows_and_invalidate_frees) {
  CacheMetadata m(1, EvictionPolicy::kOracle);
  m.Advance(0);
  std::vector<int64_t> keys = {10, 11};
  m.Admit(keys.data(), Fill(2, 4).data(), Fill(2, -1).data(), 2);
  m.Advance(1);
  std::vector<int64_t> want = {4, 5};
  auto q = m.Query(keys.data(), want.data(), Fill(2, -1).data(), 2);
  CHECK_EQ(q.hit_pos.size(), 1u);
  CHECK_EQ(q.stale, 1);
  CHECK_EQ(q.miss_pos.size(), 1u);
  CHECK_EQ(q.miss_pos[0], 1);
  CHECK_EQ(m.size(), 1);
  std::vector<int64_t> res(2);
  std::vector<int64_t> ver = {4, 4};
  m.Resident(keys.data(), ver.data(), 2, res.data());
  CHECK_EQ(res[0], q.hit_slots[0]);
  CHECK_EQ(res[1], -1);
  auto freed = m.Invalidate(keys.data(), 2);
  CHECK_EQ(freed.size(), 1u);
  CHECK_EQ(m.size(), 0);
  CHECK_EQ(m.Stats().invalidations, 1);
  CheckConsistent(m);
}

TEST_CASE(cache_metadata_pin_set_version_and_note_uses) {
  CacheMetadata m(1, EvictionPolicy::kOracle);
  m.Advance(0);
  auto keys = Iota(0, 64);
  m.Admit(keys.data(), Fill(64, -1).data(), Fill(64, -1).data(), 64);
  m.Advance(1);
  std::vector<int64_t> s = {0, 1};
  m.SetVersion(s.data(), 2, 0);
  CHECK_EQ(m.Slot(0).version, 0);
  m.Pin(s.data(), 2, 2);
  auto order = m.VictimOrder();
  CHECK_EQ(order.size(), 62u);
  std::vector<int64_t> noted = {5};
  m.NoteUses(noted.data(), 1, 7);
  CHECK_EQ(m.Slot(5).next_use, 7);
  CHECK_EQ(m.VictimOrder().back(), 5);
  m.NoteUses(noted.data(), 1, 9);  // a later use does not replace the earlier one
  CHECK_EQ(m.Slot(5).next_use, 7);
  m.Advance(3);
  CHECK_EQ(m.VictimOrder().size(), 64u);
  int64_t bad = 64;
  CHECK_THROWS(bagpipe::ValueError, m.SetVersion(&bad, 1, 0));
}

TEST_CASE(cache_metadata_randomized_operations_keep_invariants) {
  for (auto policy : {EvictionPolicy::kLru, EvictionPolicy::kOracle}) {
    std::mt19937_64 rng(42);
    CacheMetadata m(1, policy);
    int64_t step = 0;
    m.Advance(step);
    for (int iter = 0; iter < 400; ++iter) {
      std::uniform_int_distribution<int> op(0, 5);
      std::uniform_int_distribution<int64_t> key(0, 199);
      std::set<int64_t> pick;
      int n = 1 + static_cast<int>(rng() % 90);
      while (static_cast<int>(pick.size()) < n) pick.insert(key(rng));
      std::vector<int64_t> keys(pick.begin(), pick.end());
      std::vector<int64_t> vers(keys.size(), 0);
      std::vector<int64_t> nus(keys.size());
      for (auto& x : nus) x = (rng() % 3 == 0) ? -1 : step + 1 + static_cast<int64_t>(rng() % 6);
      switch (op(rng)) {
        case 0: {
          m.Advance(++step);
          break;
        }
        case 1: {
          auto q = m.Query(keys.data(), vers.data(), nus.data(), keys.size());
          std::vector<int64_t> miss;
          for (auto p : q.miss_pos) miss.push_back(keys[static_cast<size_t>(p)]);
          auto a = m.Admit(miss.data(), std::vector<int64_t>(miss.size(), 0).data(),
                           std::vector<int64_t>(miss.size(), -1).data(), miss.size());
          std::set<int64_t> dest(a.slots.begin(), a.slots.end());
          CHECK_EQ(dest.size(), a.slots.size());
          break;
        }
        case 2: {
          std::vector<int64_t> slots;
          for (auto k : keys) {
            int64_t s = -1;
            m.Lookup(&k, 1, &s);
            if (s >= 0) slots.push_back(s);
          }
          m.SetVersion(slots.data(), slots.size(), 0);
          m.Pin(slots.data(), slots.size(), step + static_cast<int64_t>(rng() % 3));
          break;
        }
        case 3: {
          m.Invalidate(keys.data(), keys.size());
          break;
        }
        case 4: {
          m.NoteUses(keys.data(), keys.size(), step + 2);
          break;
        }
        default: {
          std::vector<int64_t> res(keys.size());
          m.Resident(keys.data(), vers.data(), keys.size(), res.data());
          for (size_t i = 0; i < keys.size(); ++i) {
            if (res[i] >= 0) CHECK_EQ(m.Slot(res[i]).key, keys[i]);
          }
        }
      }
      CheckConsistent(m);
    }
  }
}
