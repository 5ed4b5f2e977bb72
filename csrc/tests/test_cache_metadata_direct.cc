// The cache metadata's direct key index (key_bound small) against its hash index: the same
// answers on random streams shaped like the controller's (property-style: many seeds, sizes
// and policies), the rule that picks the index, and the key-bound errors (no silent entry for
// a key outside the table, no state change).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cache/cache_metadata.h"
#include "common/errors.h"
#include "tests/test_harness.h"

using bagpipe::cache::CacheMetadata;
using bagpipe::cache::EvictionPolicy;
using bagpipe::cache::kUnboundedKeys;
using bagpipe::cache::SlotState;

namespace {

template <typename T>
void Same(const std::vector<T>& a, const std::vector<T>& b) {
  CHECK_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK_EQ(a[i], b[i]);
}

void SameState(const CacheMetadata& a, const CacheMetadata& b) {
  CHECK_EQ(a.size(), b.size());
  for (int64_t s = 0; s < a.capacity_rows(); ++s) {
    const auto x = a.Slot(s);
    const auto y = b.Slot(s);
    CHECK_EQ(x.key, y.key);
    CHECK(x.state == y.state);
    CHECK_EQ(x.version, y.version);
    CHECK_EQ(x.next_use, y.next_use);
    CHECK_EQ(x.pin_step, y.pin_step);
  }
  Same(a.VictimOrder(), b.VictimOrder());
  const auto p = a.Stats();
  const auto q = b.Stats();
  CHECK_EQ(p.resident, q.resident);
  CHECK_EQ(p.pinned, q.pinned);
  CHECK_EQ(p.admitted, q.admitted);
  CHECK_EQ(p.evictions, q.evictions);
  CHECK_EQ(p.bypassed, q.bypassed);
  CHECK_EQ(p.stale, q.stale);
}

// Steps of Zipf-like keys over [0, universe): advance, note_uses, query, admit of the misses
// (soonest next use first), lookup + set_version, sometimes pins, invalidations, duplicate
// and out-of-range calls that must throw alike; the two metadata compared after every call.
void RunStream(EvictionPolicy policy, int64_t units, int64_t universe, int steps, uint64_t seed) {
  CacheMetadata hash(units, policy);
  CacheMetadata direct(units, policy, universe);
  CHECK(!hash.direct_index());
  CHECK(direct.direct_index());
  std::mt19937_64 rng(seed);
  std::vector<int64_t> version(static_cast<size_t>(universe), -1);
  const int64_t cap = units * 64;
  auto draw = [&](size_t n) {
    std::vector<int64_t> keys;
    std::set<int64_t> seen;
    std::uniform_real_distribution<double> u(0, 1);
    while (keys.size() < std::min<size_t>(n, static_cast<size_t>(universe))) {
      const int64_t k = static_cast<int64_t>(std::pow(u(rng), 3.0) * static_cast<double>(universe));
      if (seen.insert(k).second) keys.push_back(k);
    }
    return keys;
  };
  for (int t = 0; t < steps; ++t) {
    hash.Advance(t);
    direct.Advance(t);
    auto noted = draw(1 + rng() % static_cast<size_t>(cap));
    const int64_t use = t + 1 + static_cast<int64_t>(rng() % 4);
    hash.NoteUses(noted.data(), noted.size(), use);
    direct.NoteUses(noted.data(), noted.size(), use);
    auto keys = draw(1 + rng() % static_cast<size_t>(2 * cap));
    const size_t n = keys.size();
    std::vector<int64_t> vers(n), nus(n);
    for (size_t i = 0; i < n; ++i) {
      vers[i] = version[static_cast<size_t>(keys[i])] + (rng() % 16 == 0 ? 1 : 0);
      nus[i] = rng() % 3 == 0 ? -1 : t + 1 + static_cast<int64_t>(rng() % 8);
    }
    if (rng() % 8 == 0 && n > 1) {  // a repeated key: both reject it, nothing changes
      auto dup = keys;
      dup[n - 1] = dup[0];
      CHECK_THROWS(bagpipe::ValueError, hash.Query(dup.data(), vers.data(), nus.data(), n));
      CHECK_THROWS(bagpipe::ValueError, direct.Query(dup.data(), vers.data(), nus.data(), n));
    }
    const auto qh = hash.Query(keys.data(), vers.data(), nus.data(), n);
    const auto qd = direct.Query(keys.data(), vers.data(), nus.data(), n);
    Same(qd.hit_pos, qh.hit_pos);
    Same(qd.hit_slots, qh.hit_slots);
    Same(qd.miss_pos, qh.miss_pos);
    CHECK_EQ(qd.stale, qh.stale);
    std::vector<int64_t> order(qh.miss_pos.begin(), qh.miss_pos.end());
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return static_cast<uint64_t>(nus[a]) < static_cast<uint64_t>(nus[b]);  // -1 last
    });
    std::vector<int64_t> mk, mv, mn;
    for (int64_t p : order) {
      mk.push_back(keys[p]);
      mv.push_back(vers[p]);
      mn.push_back(nus[p]);
    }
    if (rng() % 8 == 0 && !qh.hit_pos.empty()) {  // a resident key: both reject the admit
      auto bad = mk;
      bad.push_back(keys[qh.hit_pos[0]]);
      std::vector<int64_t> bv(bad.size(), 0), bn(bad.size(), -1);
      CHECK_THROWS(bagpipe::ValueError, hash.Admit(bad.data(), bv.data(), bn.data(), bad.size()));
      CHECK_THROWS(bagpipe::ValueError,
                   direct.Admit(bad.data(), bv.data(), bn.data(), bad.size()));
    }
    const auto ah = hash.Admit(mk.data(), mv.data(), mn.data(), mk.size());
    const auto ad = direct.Admit(mk.data(), mv.data(), mn.data(), mk.size());
    Same(ad.pos, ah.pos);
    Same(ad.slots, ah.slots);
    Same(ad.evicted_keys, ah.evicted_keys);
    Same(ad.bypassed, ah.bypassed);
    for (int64_t p : ah.pos) version[static_cast<size_t>(mk[p])] = mv[p];
    std::vector<int64_t> sh(n), sd(n);
    hash.Lookup(keys.data(), n, sh.data());
    direct.Lookup(keys.data(), n, sd.data());
    Same(sd, sh);
    std::vector<int64_t> slots;
    for (size_t i = 0; i < n; ++i) {
      if (sh[i] >= 0) {
        slots.push_back(sh[i]);
        version[static_cast<size_t>(keys[i])] = t;
      }
    }
    hash.SetVersion(slots.data(), slots.size(), t);
    direct.SetVersion(slots.data(), slots.size(), t);
    if (rng() % 3 == 0) {
      hash.Pin(slots.data(), slots.size(), t + 1);
      direct.Pin(slots.data(), slots.size(), t + 1);
    }
    if (rng() % 5 == 0) {
      auto gone = draw(1 + rng() % static_cast<size_t>(cap / 4 + 1));
      Same(direct.Invalidate(gone.data(), gone.size()), hash.Invalidate(gone.data(), gone.size()));
    }
    std::vector<int64_t> rh(n), rd(n);
    hash.Resident(keys.data(), vers.data(), n, rh.data());
    direct.Resident(keys.data(), vers.data(), n, rd.data());
    Same(rd, rh);
    SameState(direct, hash);
  }
}

}  // namespace

TEST_CASE(cache_metadata_direct_index_answers_as_the_hash_index_on_random_streams) {
  uint64_t seed = 1;
  for (auto policy : {EvictionPolicy::kLru, EvictionPolicy::kOracle}) {
    for (int64_t units : {1, 2, 8}) {
      // A universe from barely above the cache to 32 keys per slot.
      for (int64_t per_slot : {2, 5, 32}) {
        RunStream(policy, units, units * 64 * per_slot, 40, seed++);
      }
    }
  }
}

TEST_CASE(cache_metadata_direct_index_rule) {
  using bagpipe::cache::kDirectIndexMaxKeys;
  CHECK(CacheMetadata::UsesDirectIndex(64, kDirectIndexMaxKeys));
  CHECK(!CacheMetadata::UsesDirectIndex(64, kDirectIndexMaxKeys + 1));
  CHECK(CacheMetadata::UsesDirectIndex(int64_t{1} << 20, int64_t{32} << 20));
  CHECK(!CacheMetadata::UsesDirectIndex(int64_t{1} << 20, (int64_t{32} << 20) + 1));
  CHECK(!CacheMetadata::UsesDirectIndex(64, kUnboundedKeys));
  CHECK_THROWS(bagpipe::ValueError, (CacheMetadata{1, EvictionPolicy::kLru, 0}));
  CHECK_THROWS(bagpipe::ValueError, (CacheMetadata{1, EvictionPolicy::kLru, -5}));
  // A bound too large for the direct index keeps the hash index, and still checks keys.
  CacheMetadata big(1, EvictionPolicy::kLru, int64_t{1} << 40);
  CHECK(!big.direct_index());
  CHECK_EQ(big.key_bound(), int64_t{1} << 40);
}

TEST_CASE(cache_metadata_rejects_keys_outside_the_key_bound_without_change) {
  for (int64_t bound : {int64_t{1000}, int64_t{1} << 40}) {  // direct, then hash index
    CacheMetadata m(1, EvictionPolicy::kOracle, bound);
    m.Advance(0);
    std::vector<int64_t> keys = {3, 7};
    std::vector<int64_t> v = {-1, -1};
    m.Admit(keys.data(), v.data(), v.data(), 2);
    std::vector<int64_t> out = {5, bound};
    CHECK_THROWS(bagpipe::ValueError, m.Query(out.data(), v.data(), v.data(), 2));
    CHECK_THROWS(bagpipe::ValueError, m.Admit(out.data(), v.data(), v.data(), 2));
    int64_t slot = 0;
    CHECK_THROWS(bagpipe::ValueError, m.Lookup(out.data(), 2, &slot));
    std::vector<int64_t> res(2);
    CHECK_THROWS(bagpipe::ValueError, m.Resident(out.data(), v.data(), 2, res.data()));
    CHECK_THROWS(bagpipe::ValueError, m.NoteUses(out.data(), 2, 3));
    CHECK_THROWS(bagpipe::ValueError, m.CountUnknownNextUses(out.data(), 2));
    CHECK_THROWS(bagpipe::ValueError, m.Invalidate(out.data(), 2));
    std::vector<int64_t> neg = {-1};
    CHECK_THROWS(bagpipe::ValueError, m.Lookup(neg.data(), 1, &slot));
    // The error names the key and the bound.
    try {
      m.Query(out.data(), v.data(), v.data(), 2);
      CHECK(false);
    } catch (const bagpipe::ValueError& e) {
      const std::string msg = e.what();
      CHECK(msg.find("keys[1] = " + std::to_string(bound)) != std::string::npos);
      CHECK(msg.find("key bound") != std::string::npos);
    }
    CHECK_EQ(m.size(), 2);
    // Nothing was marked by the failed calls: the same keys are accepted afterwards.
    std::vector<int64_t> ok = {5, 3};
    auto q = m.Query(ok.data(), v.data(), v.data(), 2);
    CHECK_EQ(q.hit_pos.size(), 1u);
    CHECK_EQ(q.miss_pos.size(), 1u);
    std::vector<int64_t> last = {bound - 1};
    auto a = m.Admit(last.data(), v.data(), v.data(), 1);
    CHECK_EQ(a.slots.size(), 1u);
    CHECK_EQ(m.size(), 3);
  }
}
