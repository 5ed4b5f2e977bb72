#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "cache/step_planner.h"
#include "common/errors.h"
#include "tests/test_harness.h"

using bagpipe::cache::PlannerOptions;
using bagpipe::cache::StepPlanner;

namespace {

using Trace = std::vector<std::vector<std::vector<int64_t>>>;  // [step][rank] -> keys

void AddAll(StepPlanner& p, const std::vector<std::vector<int64_t>>& per_rank) {
  std::vector<int64_t> flat, off = {0};
  for (const auto& k : per_rank) {
    flat.insert(flat.end(), k.begin(), k.end());
    off.push_back(static_cast<int64_t>(flat.size()));
  }
  p.AddStep(flat.data(), off.data());
}

bool Contains(const std::vector<int64_t>& v, int64_t k) {
  return std::find(v.begin(), v.end(), k) != v.end();
}

// Brute-force reference of one rank's plan (O(T^2)): the definitions of step_planner.h.
void CheckAgainstBruteForce(const Trace& tr, int rank, int64_t lookahead, bool collective) {
  const int world = static_cast<int>(tr[0].size());
  PlannerOptions o;
  o.world_size = world;
  o.rank = rank;
  o.lookahead = lookahead;
  o.num_keys = 1000;
  o.collective = collective;
  StepPlanner p(o);
  for (const auto& step : tr) AddAll(p, step);
  const int64_t T = static_cast<int64_t>(tr.size());
  auto touched_by = [&](int64_t s, int q, int64_t k) { return Contains(tr[s][q], k); };
  auto touched = [&](int64_t s, int64_t k) {
    for (int q = 0; q < world; ++q) {
      if (touched_by(s, q, k)) return true;
    }
    return false;
  };
  auto others = [&](int64_t s, int64_t k) {
    for (int q = 0; q < world; ++q) {
      if (q != rank && touched_by(s, q, k)) return true;
    }
    return false;
  };
  for (int64_t t = 0; t < T; ++t) {
    const auto& plan = p.Plan(t);
    const auto& batch = tr[t][rank];
    std::vector<int64_t> uniq;
    for (auto k : batch) {
      if (!Contains(uniq, k)) uniq.push_back(k);
    }
    CHECK(plan.unique == uniq);
    for (size_t i = 0; i < batch.size(); ++i) CHECK_EQ(plan.unique[plan.inverse[i]], batch[i]);
    for (size_t i = 0; i < uniq.size(); ++i) {
      const int64_t k = uniq[i];
      int64_t dep = -1;
      for (int64_t s = t - 1; s >= 0; --s) {
        if (touched(s, k)) {
          dep = s;
          break;
        }
      }
      CHECK_EQ(plan.dep[i], dep);
      CHECK_EQ(static_cast<bool>(plan.shared[i]), others(t, k));
      // A copy survives from a to b (a < b) unless another rank touches it in [a, b).
      auto survives = [&](int64_t a, int64_t b) {
        if (collective) return true;
        for (int64_t s = a; s < b; ++s) {
          if (others(s, k)) return false;
        }
        return true;
      };
      int64_t next = -1;
      for (int64_t u = t + 1; u < T && u <= t + lookahead; ++u) {
        if (touched_by(u, rank, k)) {
          next = survives(t, u) ? u : -1;
          break;
        }
      }
      CHECK_EQ(plan.next_use[i], next);
      int64_t prev = -1;
      for (int64_t s = t - 1; s >= 0; --s) {
        if (touched_by(s, rank, k)) {
          prev = survives(s, t) ? s : -1;
          break;
        }
      }
      CHECK_EQ(plan.prev_use[i], prev);
    }
    if (!collective) {
      // Keys another rank touches at t whose copy from rank's previous read p < t is still
      // valid (nobody else touched them in [p, t)), in union order.
      std::vector<int64_t> want, seen;
      for (int q = 0; q < world; ++q) {
        for (auto k : tr[t][q]) {
          if (Contains(seen, k)) continue;
          seen.push_back(k);
          if (!others(t, k)) continue;
          int64_t prev = -1;
          for (int64_t s = t - 1; s >= 0; --s) {
            if (touched_by(s, rank, k)) {
              prev = s;
              break;
            }
          }
          bool valid = prev >= 0;
          for (int64_t s = prev; valid && s < t; ++s) valid = !others(s, k);
          if (valid) want.push_back(k);
        }
      }
      CHECK(plan.others == want);
    } else {
      std::vector<int64_t> u;
      for (int q = 0; q < world; ++q) {
        for (auto k : tr[t][q]) {
          if (!Contains(u, k)) u.push_back(k);
        }
      }
      CHECK(plan.union_keys == u);
      for (size_t j = 0; j < u.size(); ++j) {
        bool next = t + 1 < T && touched(t + 1, u[j]);
        CHECK_EQ(static_cast<bool>(plan.s_now[j]), next);
      }
      for (size_t i = 0; i < uniq.size(); ++i) CHECK_EQ(u[plan.union_pos[i]], uniq[i]);
    }
  }
}

}  // namespace

TEST_CASE(step_planner_hand_example) {
  PlannerOptions o;
  o.world_size = 2;
  o.rank = 0;
  o.lookahead = 2;
  o.num_keys = 10;
  StepPlanner p(o);
  AddAll(p, {{1, 2, 1}, {2, 3}});  // step 0
  AddAll(p, {{4}, {1}});           // step 1: rank 1 touches 1
  AddAll(p, {{1, 4}, {}});         // step 2
  const auto& s0 = p.Plan(0);
  CHECK((s0.unique == std::vector<int64_t>{1, 2}));
  CHECK((s0.inverse == std::vector<int64_t>{0, 1, 0}));
  CHECK((s0.dep == std::vector<int64_t>{-1, -1}));
  CHECK((s0.shared == std::vector<uint8_t>{0, 1}));
  CHECK(s0.others.empty());  // rank 0 held no copy of 2 or 3 before step 0
  // Step 1: rank 1 touches key 1, whose copy rank 0 holds from step 0: drop it.
  CHECK((p.Plan(1).others == std::vector<int64_t>{1}));
  // Key 1 is read again at step 2, but rank 1 touches it at step 1: the copy is invalidated.
  CHECK((s0.next_use == std::vector<int64_t>{-1, -1}));
  const auto& s1 = p.Plan(1);
  CHECK((s1.next_use == std::vector<int64_t>{2}));
  const auto& s2 = p.Plan(2);
  CHECK((s2.dep == std::vector<int64_t>{1, 1}));
  CHECK((s2.prev_use == std::vector<int64_t>{-1, 1}));
  CHECK_EQ(s2.global_ids, 2);
}

TEST_CASE(step_planner_other_ranks_distinct_keys_give_the_same_plan) {
  PlannerOptions o;
  o.world_size = 2;
  o.rank = 1;
  o.lookahead = 3;
  o.num_keys = 50;
  StepPlanner full(o), distinct(o);
  std::mt19937_64 rng(7);
  for (int step = 0; step < 12; ++step) {
    std::vector<int64_t> mine, theirs, theirs_unique;
    for (int i = 0; i < 20; ++i) mine.push_back(static_cast<int64_t>(rng() % 30));
    for (int i = 0; i < 25; ++i) theirs.push_back(static_cast<int64_t>(rng() % 30));
    for (auto k : theirs) {
      if (!Contains(theirs_unique, k)) theirs_unique.push_back(k);
    }
    AddAll(full, {theirs, mine});
    std::vector<int64_t> flat = theirs_unique;
    flat.insert(flat.end(), mine.begin(), mine.end());
    std::vector<int64_t> off = {0, static_cast<int64_t>(theirs_unique.size()),
                                static_cast<int64_t>(flat.size())};
    distinct.AddStep(flat.data(), off.data(), 45);
    const auto& a = full.Plan(step);
    const auto& b = distinct.Plan(step);
    CHECK(a.unique == b.unique);
    CHECK(a.inverse == b.inverse);
    CHECK(a.dep == b.dep);
    CHECK(a.shared == b.shared);
    CHECK(a.others == b.others);
    CHECK(a.prev_use == b.prev_use);
    CHECK_EQ(b.global_ids, 45);
  }
  for (int step = 0; step < 12; ++step) {
    CHECK(full.Plan(step).next_use == distinct.Plan(step).next_use);
  }
}

TEST_CASE(step_planner_rejects_out_of_range_keys_without_change) {
  PlannerOptions o;
  o.world_size = 2;
  o.num_keys = 10;
  StepPlanner p(o);
  std::vector<int64_t> keys = {1, 10};
  std::vector<int64_t> off = {0, 1, 2};
  CHECK_THROWS(bagpipe::ValueError, p.AddStep(keys.data(), off.data()));
  CHECK_EQ(p.num_steps(), 0);
  std::vector<int64_t> ok = {1, 1};
  p.AddStep(ok.data(), off.data());
  CHECK_EQ(p.Plan(0).dep[0], -1);  // the failed step left no trace
  CHECK_EQ(p.distinct_keys(), 1);
  std::vector<int64_t> bad_off = {0, 2, 1};
  CHECK_THROWS(bagpipe::ValueError, p.AddStep(ok.data(), bad_off.data()));
  o.rank = 2;
  CHECK_THROWS(bagpipe::ValueError, StepPlanner{o});
}

TEST_CASE(step_planner_release_keeps_later_steps) {
  PlannerOptions o;
  o.world_size = 1;
  o.num_keys = 100;
  o.lookahead = 3;
  StepPlanner p(o);
  for (int s = 0; s < 6; ++s) AddAll(p, {{s % 3}});
  p.Release(4);
  CHECK_EQ(p.first_retained(), 4);
  CHECK_THROWS(bagpipe::ValueError, p.Plan(3));
  CHECK_EQ(p.Plan(4).dep[0], 1);
  AddAll(p, {{1}});  // patches the retained step 4, skips released ones
  CHECK_EQ(p.Plan(4).next_use[0], 6);
}

TEST_CASE(step_planner_matches_brute_force_on_random_traces) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 30; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 4);
    const int steps = 1 + static_cast<int>(rng() % 12);
    const int universe = 2 + static_cast<int>(rng() % 20);
    Trace tr(steps, std::vector<std::vector<int64_t>>(world));
    for (auto& step : tr) {
      for (auto& keys : step) {
        const int n = static_cast<int>(rng() % 8);
        for (int i = 0; i < n; ++i) {
          // Skewed: small keys are far more likely.
          int64_t a = static_cast<int64_t>(rng() % universe);
          int64_t b = static_cast<int64_t>(rng() % universe);
          keys.push_back(std::min(a, b));
        }
      }
    }
    const int64_t lookahead = static_cast<int64_t>(rng() % 5);
    for (int rank = 0; rank < world; ++rank) {
      CheckAgainstBruteForce(tr, rank, lookahead, false);
      CheckAgainstBruteForce(tr, rank, lookahead, true);
    }
  }
}
