// The virtual tables' eviction rule (cache/eviction_rule.h) and its effect on the step
// planner (step_planner.h invariant 8): hand examples.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cache/eviction_rule.h"
#include "cache/step_planner.h"
#include "common/errors.h"
#include "protocol/wire.h"
#include "tests/test_harness.h"

using bagpipe::cache::AdmitCoin;
using bagpipe::cache::EvictionRule;
using bagpipe::cache::EvictionRuleOptions;
using bagpipe::cache::PlannerOptions;
using bagpipe::cache::StepPlanner;

namespace {

std::vector<int64_t> Step(EvictionRule& r, int64_t s, std::vector<int64_t> keys) {
  std::vector<int64_t> out;
  r.OnStep(s, keys.data(), keys.size(), &out);
  return out;
}

void AddAll(StepPlanner& p, const std::vector<std::vector<int64_t>>& per_rank) {
  std::vector<int64_t> flat, off = {0};
  for (const auto& k : per_rank) {
    flat.insert(flat.end(), k.begin(), k.end());
    off.push_back(static_cast<int64_t>(flat.size()));
  }
  p.AddStep(flat.data(), off.data());
}

}  // namespace

TEST_CASE(eviction_rule_step_ttl_and_trigger) {
  EvictionRuleOptions o;
  o.ttl_steps = 2;
  EvictionRule r(o);
  CHECK(Step(r, 0, {5, 1, int64_t{1} << 50}).empty());
  CHECK(Step(r, 1, {5}).empty());
  CHECK((Step(r, 2, {7}) == std::vector<int64_t>{1, int64_t{1} << 50}));  // sorted
  CHECK_EQ(r.live(), 2);
  CHECK_EQ(r.created(), 4);
  CHECK_EQ(r.evicted(), 2);
  // With a trigger, rounds run only while live rows exceed it.
  o.trigger_rows = 3;
  EvictionRule t(o);
  CHECK(Step(t, 0, {1, 2, 3}).empty());
  CHECK(Step(t, 5, {}).empty());                                   // 3 live: no round
  CHECK((Step(t, 6, {4}) == std::vector<int64_t>{1, 2, 3}));        // 4 live: a round
  CHECK_EQ(t.rounds(), 1);
}

TEST_CASE(eviction_rule_counts_decay_each_round) {
  EvictionRuleOptions o;
  o.threshold = 1.5;
  o.decay_rate = 0.5;
  EvictionRule r(o);
  CHECK(Step(r, 0, {1, 2}).empty());  // trained now: kept (counts 0.5 after the decay)
  CHECK((Step(r, 1, {2}) == std::vector<int64_t>{1}));  // 1: 0.25 < 1.5; 2: (0.5+1)*0.5
  double count = 0;
  int64_t last = 0;
  CHECK(r.Get(2, &count, &last));
  CHECK(count == 0.75 && last == 1);
  CHECK(!r.Get(1, &count, &last));
  CHECK((Step(r, 3, {1}) == std::vector<int64_t>{2}));  // 1 comes back as new (count 1)
  CHECK(r.Get(1, &count, &last) && count == 0.5);
  o.decay_rate = 0.0;
  CHECK_THROWS(bagpipe::ValueError, EvictionRule bad(o));
  CHECK_THROWS(bagpipe::ValueError, Step(r, 3, {}));  // steps must increase
}

TEST_CASE(step_planner_treats_an_eviction_as_a_write) {
  for (bool collective : {false, true}) {
    PlannerOptions o;
    o.world_size = 2;
    o.rank = 0;
    o.lookahead = 4;
    o.num_keys = int64_t{1} << 50;
    o.collective = collective;
    o.eviction.ttl_steps = 1;
    StepPlanner p(o);
    AddAll(p, {{1, 2}, {3}});  // step 0
    AddAll(p, {{2}, {}});      // step 1: 1 and 3 are evicted at its boundary
    AddAll(p, {{1}, {3}});     // step 2: both recreated
    CHECK(p.Plan(0).evicted.empty());
    CHECK((p.Plan(1).evicted == std::vector<int64_t>{1, 3}));
    // Step 2 reads 1 after the eviction: its dependency is the eviction's step, and rank 0's
    // copy from step 0 is no next use of step 2.
    CHECK((p.Plan(2).dep == std::vector<int64_t>{1}));
    CHECK((p.Plan(0).next_use == std::vector<int64_t>{-1, 1}));
    CHECK((p.Plan(2).prev_use == std::vector<int64_t>{-1}));
    CHECK((p.Plan(2).evicted == std::vector<int64_t>{2}));
    CHECK_EQ(p.eviction().live(), 2);
  }
}

TEST_CASE(wire_commit_carries_evicted_keys_in_chunks_of_their_own) {
  namespace wire = bagpipe::protocol::wire;
  wire::CommitBody b{};
  b.session = 1;
  b.step = 2;
  b.world_size = 1;
  b.chunk_count = 1;
  b.dim = 3;
  b.lr = 0.5f;
  b.nevict = 2;
  std::vector<uint8_t> body(sizeof(b) + 16);
  std::memcpy(body.data(), &b, sizeof(b));
  const int64_t keys[2] = {7, int64_t{1} << 50};
  std::memcpy(body.data() + sizeof(b), keys, 16);
  wire::CommitView v;
  std::string why;
  CHECK(wire::ParseCommit(body.data(), body.size(), &v, &why));
  CHECK_EQ(v.body.nevict, 2u);
  CHECK_EQ(v.evict[1], int64_t{1} << 50);
  CHECK_EQ(v.payload_len, size_t{16});
  CHECK(!wire::ParseCommit(body.data(), body.size() - 8, &v, &why));  // short by a key
  b.nrows = 1;  // rows and evicted keys in one chunk: refused (alignment, invariant 3)
  std::vector<uint8_t> mixed(sizeof(b) + 8 + 12 + 16);
  std::memcpy(mixed.data(), &b, sizeof(b));
  CHECK(!wire::ParseCommit(mixed.data(), mixed.size(), &v, &why));
  CHECK(why.find("not both") != std::string::npos);
}

TEST_CASE(eviction_rule_admits_after_n_steps_and_again_after_eviction) {
  EvictionRuleOptions o;
  o.admit_after = 2;
  o.ttl_steps = 1;
  EvictionRule r(o);
  CHECK(!r.Admit(9));                 // step 0: first read, not admitted
  CHECK(Step(r, 0, {}).empty());
  CHECK(r.Admit(9));                  // step 1: second step: admitted, trained
  CHECK(Step(r, 1, {9}).empty());
  CHECK(r.Admit(9));                  // live: admitted
  CHECK(Step(r, 2, {}) == std::vector<int64_t>{9});  // TTL 1: evicted
  CHECK(!r.Admit(9));                 // after an eviction it starts over
  CHECK_EQ(r.live(), 0);
}

TEST_CASE(eviction_rule_admits_with_a_seeded_coin) {
  EvictionRuleOptions o;
  o.admit_probability = 0.25;
  o.admit_seed = 42;
  EvictionRule r(o);
  // Each read step of a not-live id: admitted exactly when its coin for that step is below p.
  int admitted = 0;
  for (int64_t key = 0; key < 400; ++key) {
    int64_t n = 1;
    while (AdmitCoin(42, key, n) >= 0.25) ++n;  // the first step whose coin comes up
    for (int64_t i = 1; i < n; ++i) CHECK(!r.Admit(key));
    CHECK(r.Admit(key));
    admitted += n == 1;
  }
  CHECK(admitted > 60 && admitted < 140);  // ~ 400 x 0.25 at the first read
  for (int64_t n = 1; n < 1000; ++n) {
    const double u = AdmitCoin(7, 3, n);
    CHECK(u >= 0.0 && u < 1.0);
  }
  CHECK(AdmitCoin(1, 5, 1) != AdmitCoin(2, 5, 1));  // the seed changes the coins
  EvictionRuleOptions bad;
  bad.admit_probability = 0.0;
  bool threw = false;
  try {
    EvictionRule bad_rule(bad);
  } catch (const bagpipe::ValueError&) {
    threw = true;
  }
  CHECK(threw);
}

TEST_CASE(eviction_rule_cap_evicts_the_oldest_rows_first) {
  EvictionRuleOptions o;
  o.max_rows = 2;
  EvictionRule r(o);
  CHECK(Step(r, 0, {5, 6}).empty());
  CHECK(Step(r, 1, {7}) == std::vector<int64_t>{5});     // 5 and 6 tie on last: lowest key
  CHECK(Step(r, 2, {6, 8}) == std::vector<int64_t>{7});  // 7 is older than nothing trained
  CHECK_EQ(r.live(), 2);
  CHECK(Step(r, 3, {1, 2, 3}) == (std::vector<int64_t>{6, 8}));  // step 3 alone is over
  CHECK_EQ(r.live(), 3);  // the cap cannot evict keys trained at the step
}
