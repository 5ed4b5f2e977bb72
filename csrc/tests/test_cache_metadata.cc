#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "cache/cache_metadata.h"
#include "tests/cache_metadata_reference.h"
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
  std::vector<int64_t> rkeys, rslots;
  m.ResidentSlots(&rkeys, &rslots);
  CHECK_EQ(static_cast<int64_t>(rslots.size()), resident);
  for (size_t i = 0; i < rslots.size(); ++i) CHECK_EQ(m.Slot(rslots[i]).key, rkeys[i]);
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
      // CountUnknownNextUses is the slots' own answer (0 under lru).
      int64_t unknown = 0;
      for (auto k : keys) {
        int64_t s = -1;
        m.Lookup(&k, 1, &s);
        if (s >= 0 && m.Slot(s).next_use == kNever) ++unknown;
      }
      CHECK_EQ(m.CountUnknownNextUses(keys.data(), keys.size()),
               policy == EvictionPolicy::kOracle ? unknown : 0);
    }
  }
}

// ---- the optimized metadata against the reference implementation, call by call ----------

namespace {

using bagpipe::cache::reference::ReferenceCacheMetadata;

template <typename T>
void CheckSameVector(const std::vector<T>& a, const std::vector<T>& b) {
  CHECK_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK_EQ(a[i], b[i]);
}

// Every slot, the victim order and the counters agree.
void CheckSameState(const CacheMetadata& m, const ReferenceCacheMetadata& r) {
  CHECK_EQ(m.size(), r.size());
  for (int64_t s = 0; s < m.capacity_rows(); ++s) {
    const auto a = m.Slot(s);
    const auto b = r.Slot(s);
    CHECK_EQ(a.key, b.key);
    CHECK(a.state == b.state);
    if (a.state != SlotState::kFree) {
      CHECK_EQ(a.version, b.version);
      CHECK_EQ(a.next_use, b.next_use);
      CHECK_EQ(a.pin_step, b.pin_step);
    }
  }
  CheckSameVector(m.VictimOrder(), r.VictimOrder());
  const auto x = m.Stats();
  const auto y = r.Stats();
  CHECK_EQ(x.resident, y.resident);
  CHECK_EQ(x.pinned, y.pinned);
  CHECK_EQ(x.admitted, y.admitted);
  CHECK_EQ(x.bypassed, y.bypassed);
  CHECK_EQ(x.evictions, y.evictions);
  CHECK_EQ(x.invalidations, y.invalidations);
  CHECK_EQ(x.stale, y.stale);
}

// A random workload shaped like the controller's (query, then admit of the misses in
// soonest-next-use order or as they come; advances; note_uses; local updates; pins;
// invalidations; rare clears), run on `ms` (optimized, possibly with tiny generation
// periods) and on the reference, comparing every answer.
void RunAgainstReference(EvictionPolicy policy, int64_t units, int64_t universe, int ops,
                         uint64_t seed, std::vector<CacheMetadata*> ms) {
  std::mt19937_64 rng(seed);
  ReferenceCacheMetadata ref(units, policy);
  int64_t step = 0;
  ref.Advance(step);
  for (auto* m : ms) m->Advance(step);
  std::vector<int64_t> version(static_cast<size_t>(universe), -1);
  auto draw_keys = [&](size_t n) {
    std::vector<int64_t> keys;
    std::set<int64_t> seen;
    while (keys.size() < n) {
      // Skewed: low keys are hot.
      const double u = std::uniform_real_distribution<double>(0, 1)(rng);
      const int64_t k = static_cast<int64_t>(std::pow(u, 2.5) * static_cast<double>(universe));
      if (seen.insert(k).second) keys.push_back(k);
    }
    return keys;
  };
  const int64_t cap = units * 64;
  for (int op = 0; op < ops; ++op) {
    const int kind = static_cast<int>(rng() % 100);
    if (kind < 15) {
      step += 1 + static_cast<int64_t>(rng() % 2);
      ref.Advance(step);
      for (auto* m : ms) m->Advance(step);
    } else if (kind < 60) {
      const size_t n = 1 + rng() % static_cast<size_t>(2 * cap);
      auto keys = draw_keys(std::min<size_t>(n, static_cast<size_t>(universe)));
      std::vector<int64_t> vers(keys.size()), nus(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        vers[i] = version[static_cast<size_t>(keys[i])] + (rng() % 10 == 0 ? 1 : 0);
        nus[i] = rng() % 3 == 0 ? -1 : step + 1 + static_cast<int64_t>(rng() % 8);
      }
      const auto want = ref.Query(keys.data(), vers.data(), nus.data(), keys.size());
      for (auto* m : ms) {
        const auto got = m->Query(keys.data(), vers.data(), nus.data(), keys.size());
        CheckSameVector(got.hit_pos, want.hit_pos);
        CheckSameVector(got.hit_slots, want.hit_slots);
        CheckSameVector(got.miss_pos, want.miss_pos);
        CHECK_EQ(got.stale, want.stale);
      }
      std::vector<int64_t> order(want.miss_pos.begin(), want.miss_pos.end());
      if (rng() % 4 != 0) {
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
          const int64_t x = nus[a] < 0 ? INT64_MAX : nus[a];
          const int64_t y = nus[b] < 0 ? INT64_MAX : nus[b];
          return x < y;
        });
      }
      std::vector<int64_t> mk, mv, mn;
      for (int64_t p : order) {
        mk.push_back(keys[p]);
        mv.push_back(vers[p]);
        mn.push_back(nus[p]);
      }
      const auto wa = ref.Admit(mk.data(), mv.data(), mn.data(), mk.size());
      for (auto* m : ms) {
        const auto ga = m->Admit(mk.data(), mv.data(), mn.data(), mk.size());
        CheckSameVector(ga.pos, wa.pos);
        CheckSameVector(ga.slots, wa.slots);
        CheckSameVector(ga.evicted_keys, wa.evicted_keys);
        CheckSameVector(ga.bypassed, wa.bypassed);
      }
      for (size_t i = 0; i < wa.pos.size(); ++i) {
        version[static_cast<size_t>(mk[static_cast<size_t>(wa.pos[i])])] =
            mv[static_cast<size_t>(wa.pos[i])];
      }
    } else if (kind < 72) {
      // The local update: lookup, set_version, sometimes a pin through the next step.
      auto keys = draw_keys(1 + rng() % static_cast<size_t>(cap));
      std::vector<int64_t> want(keys.size()), got(keys.size());
      ref.Lookup(keys.data(), keys.size(), want.data());
      for (auto* m : ms) {
        m->Lookup(keys.data(), keys.size(), got.data());
        CheckSameVector(got, want);
      }
      std::vector<int64_t> slots;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (want[i] >= 0) {
          slots.push_back(want[i]);
          version[static_cast<size_t>(keys[i])] = step;
        }
      }
      ref.SetVersion(slots.data(), slots.size(), step);
      for (auto* m : ms) m->SetVersion(slots.data(), slots.size(), step);
      if (rng() % 2 == 0) {
        ref.Pin(slots.data(), slots.size(), step + 1);
        for (auto* m : ms) m->Pin(slots.data(), slots.size(), step + 1);
      }
    } else if (kind < 82) {
      auto keys = draw_keys(1 + rng() % static_cast<size_t>(cap));
      const int64_t use = step + 1 + static_cast<int64_t>(rng() % 8);
      ref.NoteUses(keys.data(), keys.size(), use);
      for (auto* m : ms) m->NoteUses(keys.data(), keys.size(), use);
    } else if (kind < 90) {
      auto keys = draw_keys(1 + rng() % static_cast<size_t>(cap / 2 + 1));
      std::vector<int64_t> vers(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) vers[i] = version[static_cast<size_t>(keys[i])];
      std::vector<int64_t> want(keys.size()), got(keys.size());
      ref.Resident(keys.data(), vers.data(), keys.size(), want.data());
      for (auto* m : ms) {
        m->Resident(keys.data(), vers.data(), keys.size(), got.data());
        CheckSameVector(got, want);
      }
    } else if (kind < 99) {
      auto keys = draw_keys(1 + rng() % static_cast<size_t>(cap / 4 + 1));
      keys.push_back(keys.front());  // a repeated key is freed once
      const auto want = ref.Invalidate(keys.data(), keys.size());
      for (auto* m : ms) CheckSameVector(m->Invalidate(keys.data(), keys.size()), want);
    } else {
      ref.Clear();
      for (auto* m : ms) m->Clear();
    }
    if (op % 8 == 0) {
      for (auto* m : ms) CheckSameState(*m, ref);
    }
  }
  for (auto* m : ms) CheckSameState(*m, ref);
}

}  // namespace

TEST_CASE(cache_metadata_matches_the_reference_call_by_call) {
  for (auto policy : {EvictionPolicy::kLru, EvictionPolicy::kOracle}) {
    for (int64_t units : {1, 3, 16}) {
      // Generation periods 2 and 4 purge stale queue entries every few bumps; the default
      // almost never does: all three must answer alike.
      // The hash index (no key bound) and the direct index (key_bound = the universe).
      const int64_t universe = units * 64 * 3;
      CacheMetadata plain(units, policy);
      CacheMetadata period2(units, policy);
      CacheMetadata period4(units, policy);
      CacheMetadata direct(units, policy, universe);
      CacheMetadata direct2(units, policy, universe);
      period2.SetGenerationPeriodForTest(2);
      period4.SetGenerationPeriodForTest(4);
      direct2.SetGenerationPeriodForTest(2);
      CHECK(!plain.direct_index());
      CHECK(direct.direct_index());
      RunAgainstReference(policy, units, universe, 600, 7 + static_cast<uint64_t>(units),
                          {&plain, &period2, &period4, &direct, &direct2});
    }
  }
}

TEST_CASE(cache_metadata_keeps_the_reference_order_through_many_compactions) {
  // A cache of 4096 rows over many steps: the queues are compacted many times over.
  CacheMetadata m(64, EvictionPolicy::kOracle);
  CacheMetadata direct(64, EvictionPolicy::kOracle, 64 * 64 * 4);
  RunAgainstReference(EvictionPolicy::kOracle, 64, 64 * 64 * 4, 400, 99, {&m, &direct});
}

TEST_CASE(cache_metadata_rejects_values_beyond_32_bits_without_change) {
  CacheMetadata m(1, EvictionPolicy::kOracle);
  m.Advance(0);
  int64_t k = 5, v = -1, big = int64_t{1} << 31, huge_version = int64_t{1} << 40;
  CHECK_THROWS(bagpipe::ValueError, m.Admit(&k, &v, &big, 1));
  CHECK_THROWS(bagpipe::ValueError, m.Admit(&k, &huge_version, &v, 1));
  CHECK_THROWS(bagpipe::ValueError, m.Query(&k, &v, &big, 1));
  CHECK_THROWS(bagpipe::ValueError, m.Advance(int64_t{1} << 31));
  CHECK_EQ(m.size(), 0);
  m.Admit(&k, &v, &v, 1);
  int64_t slot = 0;
  CHECK_THROWS(bagpipe::ValueError, m.SetVersion(&slot, 1, huge_version));
  CHECK_THROWS(bagpipe::ValueError, m.Pin(&slot, 1, huge_version));
  CHECK_EQ(m.Slot(0).version, -1);
  // A query version outside 32 bits is simply not the stored one: the row is stale.
  auto q = m.Query(&k, &huge_version, &v, 1);
  CHECK_EQ(q.stale, 1);
  CHECK_EQ(m.size(), 0);
}
