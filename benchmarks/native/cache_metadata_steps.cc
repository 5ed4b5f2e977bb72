// cache_metadata_steps: the cache metadata's per-step work as the BagPipe controller issues it,
// without Python, for profilers (perf, valgrind --tool=callgrind: instruction counts are
// repeatable on a shared machine where times are not).
//
// Workload (as benchmarks/cache_policy.py's metadata part): every step is `ids` IDs of
// Zipf(1.05) ranks over `rows` rows, scattered over the key space by a fixed multiplier; one
// rank (W = 1) plans them with the native StepPlanner (lookahead L) and runs, per step t, the
// controller's sequence (runtime/controller.py, prefetch.py, step_assembly.py,
// ps_aggregation.py):
//   advance(t); note_uses of the step entering the window (keys whose previous read is
//   before t); query(unique, deps, next_use) with next uses inside the entered window;
//   admit of the misses in soonest-next-use order (stable; none last); lookup + set_version
//   of the step's resident keys (the local SGD update).
// The cache holds `cache_pct` percent of the rows (oracle eviction).
//
// Output: a JSON line with query + admit IDs/s (unique keys per second, the controller's
// count) and ms per step, and one with each call kind's ms per step; medians over the timed
// steps of this thread's CPU time.
//
// Build: cmake --build build/dev --target bagpipe_cache_metadata_steps
// Run:   build/dev/bagpipe_cache_metadata_steps [--rows N] [--ids N] [--steps S] [--warmup W]
//                                               [--lookahead L] [--cache-pct P]
//                                               [--index direct|hash]
// --index: the key -> slot index. direct (default): key_bound = rows, as the controller
// passes the table's rows (the direct index when cache_metadata.h's rule allows it); hash:
// no key bound, the hash index.
#include <algorithm>
#include <ctime>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache/cache_metadata.h"
#include "cache/step_planner.h"

namespace {

using bagpipe::cache::CacheMetadata;
using bagpipe::cache::EvictionPolicy;
using bagpipe::cache::RankPlan;
using bagpipe::cache::StepPlanner;

constexpr uint64_t kScatter = 2654435761ull;  // as benchmarks/cache_policy.py

struct Args {
  int64_t rows = 10'000'000;
  int64_t ids = 180'000;
  int steps = 40;
  int warmup = 10;
  int64_t lookahead = 8;
  double cache_pct = 5.0;
  bool hash_index = false;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--rows") a.rows = std::atoll(v);
    else if (k == "--ids") a.ids = std::atoll(v);
    else if (k == "--steps") a.steps = std::atoi(v);
    else if (k == "--warmup") a.warmup = std::atoi(v);
    else if (k == "--lookahead") a.lookahead = std::atoll(v);
    else if (k == "--cache-pct") a.cache_pct = std::atof(v);
    else if (k == "--index") a.hash_index = std::string(v) == "hash";
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

// Bounded Zipf ranks in [0, rows) by the continuous inverse CDF, scattered.
std::vector<int64_t> ZipfKeys(std::mt19937_64& rng, int64_t rows, int64_t n) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double e = 1.0 - 1.05;
  const double top = std::pow(static_cast<double>(rows) + 1.0, e) - 1.0;
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (auto& k : out) {
    double r = std::floor(std::pow(top * u(rng) + 1.0, 1.0 / e)) - 1.0;
    r = std::clamp(r, 0.0, static_cast<double>(rows - 1));
    k = static_cast<int64_t>((static_cast<uint64_t>(r) * kScatter) % static_cast<uint64_t>(rows));
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// This thread's CPU time: on a shared, loaded machine it leaves out the time other processes
// held the core (wall time does not).
double Now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  std::mt19937_64 rng(1);
  bagpipe::cache::PlannerOptions po;
  po.world_size = 1;
  po.rank = 0;
  po.lookahead = a.lookahead;
  po.num_keys = a.rows;
  StepPlanner planner(po);
  std::vector<double> plan_s;
  for (int s = 0; s < a.steps; ++s) {
    const auto keys = ZipfKeys(rng, a.rows, a.ids);
    const int64_t off[2] = {0, a.ids};
    const double t0 = Now();
    planner.AddStep(keys.data(), off);
    plan_s.push_back(Now() - t0);
  }
  const int64_t units =
      std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(a.rows) * a.cache_pct / 100 / 64));
  CacheMetadata meta(units, EvictionPolicy::kOracle,
                     a.hash_index ? bagpipe::cache::kUnboundedKeys : a.rows);

  std::vector<double> t_adv, t_note, t_query, t_admit, t_update, keys_q;
  int64_t hits = 0, accesses = 0;
  int64_t entered = -1;
  std::vector<int64_t> buf_a, buf_b, buf_c, hit_pos, hit_slots, miss_pos, order, slots;
  for (int t = 0; t < a.steps; ++t) {
    double t0 = Now();
    meta.Advance(t);
    const double t1 = Now();
    const int64_t upto = std::min<int64_t>(t + a.lookahead, a.steps - 1);
    for (int64_t s = entered + 1; s <= upto; ++s) {
      entered = s;
      if (s <= t) continue;
      const RankPlan& p = planner.Plan(s);
      buf_a.clear();
      for (size_t i = 0; i < p.unique.size(); ++i) {
        if (p.prev_use[i] >= 0 && p.prev_use[i] < t) buf_a.push_back(p.unique[i]);
      }
      meta.NoteUses(buf_a.data(), buf_a.size(), s);
    }
    const double t2 = Now();
    const RankPlan& p = planner.Plan(t);
    const size_t n = p.unique.size();
    // Next uses beyond the entered window are unknown yet (step_assembly.py).
    buf_b.resize(n);
    for (size_t i = 0; i < n; ++i) buf_b[i] = p.next_use[i] <= entered ? p.next_use[i] : -1;
    hit_pos.resize(n);
    hit_slots.resize(n);
    miss_pos.resize(n);
    const double t3 = Now();
    const auto q = meta.QueryInto(p.unique.data(), p.dep.data(), buf_b.data(), n,
                                  {hit_pos.data(), hit_slots.data(), miss_pos.data()});
    const double t4 = Now();
    // Misses in soonest-next-use order, stable (argsort of the horizon-clipped distance).
    order.assign(miss_pos.begin(), miss_pos.begin() + q.misses);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      const int64_t rx = buf_b[x] < 0 ? INT64_MAX : buf_b[x];
      const int64_t ry = buf_b[y] < 0 ? INT64_MAX : buf_b[y];
      return rx < ry;
    });
    const size_t m = order.size();
    buf_a.resize(m);
    buf_c.resize(m);
    std::vector<int64_t> mdeps(m);
    for (size_t i = 0; i < m; ++i) {
      buf_a[i] = p.unique[order[i]];
      mdeps[i] = p.dep[order[i]];
      buf_c[i] = buf_b[order[i]];
    }
    std::vector<int64_t> o1(m), o2(m), o3(m), o4(m);
    const double t5 = Now();
    meta.AdmitInto(buf_a.data(), mdeps.data(), buf_c.data(), m,
                   {o1.data(), o2.data(), o3.data(), o4.data()});
    const double t6 = Now();
    slots.resize(n);
    meta.Lookup(p.unique.data(), n, slots.data());
    size_t k = 0;
    for (size_t i = 0; i < n; ++i) {
      if (slots[i] >= 0) slots[k++] = slots[i];
    }
    meta.SetVersion(slots.data(), k, t);
    const double t7 = Now();
    if (t >= a.warmup) {
      t_adv.push_back(t1 - t0);
      t_note.push_back(t2 - t1);
      t_query.push_back(t4 - t3);
      t_admit.push_back(t6 - t5);
      t_update.push_back(t7 - t6);
      keys_q.push_back(static_cast<double>(n));
      hits += q.hits;
      accesses += static_cast<int64_t>(n);
    }
    (void)t0;
  }
  std::vector<double> qa;
  for (size_t i = 0; i < t_query.size(); ++i) qa.push_back((t_query[i] + t_admit[i]) / keys_q[i]);
  const double per_key = Median(qa);
  const double unique = Median(keys_q);
  std::printf(
      "{\"bench\":\"cache_metadata_steps\",\"metric\":\"query_admit_ids_per_s\",\"value\":%.4g,"
      "\"unit\":\"ids/s\",\"ms_per_step\":%.4g,\"unique_per_step\":%.0f,\"ids_per_step\":%lld,"
      "\"hit_rate\":%.4f,\"rows\":%lld,\"cache_rows\":%lld,\"lookahead\":%lld,\"threads\":1,"
      "\"index\":\"%s\"}\n",
      1.0 / per_key, per_key * unique * 1e3, unique, static_cast<long long>(a.ids),
      static_cast<double>(hits) / static_cast<double>(std::max<int64_t>(accesses, 1)),
      static_cast<long long>(a.rows), static_cast<long long>(meta.capacity_rows()),
      static_cast<long long>(a.lookahead), meta.direct_index() ? "direct" : "hash");
  std::printf(
      "{\"bench\":\"cache_metadata_steps\",\"metric\":\"ms_per_step\",\"advance\":%.3f,"
      "\"note_uses\":%.3f,\"query\":%.3f,\"admit\":%.3f,\"lookup_set_version\":%.3f,"
      "\"planner_ids_per_s\":%.4g}\n",
      Median(t_adv) * 1e3, Median(t_note) * 1e3, Median(t_query) * 1e3, Median(t_admit) * 1e3,
      Median(t_update) * 1e3, static_cast<double>(a.ids) / Median(plan_s));
  return 0;
}
