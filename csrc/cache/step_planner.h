// StepPlanner: the global facts of every step's accesses, seen from one rank.
//
// Fed the fused keys of every rank for one step at a time (prescan: the whole trace before
// training; online: each batch as it enters the lookahead window), it derives for the
// planner's rank r and every step t a RankPlan: r's unique keys (first-occurrence order)
// with the inverse of its batch, each unique key's dependency step (the last global step
// < t that touched the key, -1 never), whether another rank touches it at t, r's next read
// of it inside the lookahead window, the keys other ranks touch at t of which r holds a valid
// copy (what r must invalidate), and, for collective aggregation, the global union of keys with the rows the
// next step reads (S_now).
//
// Thread safety: none; one owner serializes every call.
//
// Invariants:
//   1. Plans depend only on the sequence of AddStep inputs and the options: prescan (all
//      steps at once) and online (one at a time) produce identical plans.
//   2. dep[i] < t for every unique key of step t, and dep[i] is the largest such step whose
//      union contains the key.
//   3. next_use[i] of step t is the first step u in (t, t + lookahead] at which r reads the
//      key again, provided the copy r holds after t stays valid until u (with `ps`
//      aggregation a touch by another rank in [t, u) invalidates it); -1 otherwise. It is
//      patched when step u is added, so it is final once step t + lookahead is added.
//   4. prev_use[i] of step t is r's previous read p of the key when the copy from p stays
//      valid until t (the same rule), -1 otherwise: next_use of step p equals t iff
//      prev_use equals p and t - p <= lookahead.
//   5. others of step t (ps aggregation) lists, in union order, every key another rank
//      touches at t for which r holds a valid copy from its previous read p < t (no other
//      rank touched the key in [p, t)): the only keys r can have cached at t that another
//      rank updates at t, i.e. what r invalidates after t.
//   6. A failing AddStep (a key outside [0, num_keys)) changes nothing.
//   7. Memory: the retained plans (proportional to the retained trace) plus one entry per
//      distinct key ever seen.
//   8. Virtual tables (options.eviction enabled): evicted of step t lists the keys evicted at
//      t's boundary (cache/eviction_rule.h, fed each step's union), the same on every rank.
//      An eviction acts as a write at step t: a later read's dep is >= t, and r's copy of an
//      evicted key is invalid from t on (no next_use reaches past it; r drops it after t).
//   9. Admission (options.eviction.admit_after > 1): an id the rule does not admit at step t
//      is in no key list of the plan (no read, write or dependency); its positions in r's
//      batch have inverse -1 (they read as zeros, their gradient is dropped).
//  10. Replicated (write-back aggregation): r "reads" the whole union of every step: unique
//      equals union_keys (union_pos the identity), inverse maps r's batch into the union,
//      and dep / next_use / prev_use / s_now are those of the union (a key's reads are every
//      rank's), never shared. Every rank's plan holds the same keys and facts, so caches
//      driven by them make the same decisions on every rank. own_pos / own_inverse give r's
//      own unique keys (first-occurrence order, as a non-replicated plan's unique) and
//      batch: unique[own_pos[own_inverse[i]]] is r's i-th id.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "cache/eviction_rule.h"
#include "cache/flat_map.h"

namespace bagpipe::cache {

struct PlannerOptions {
  int world_size = 1;        // REQUIRES: >= 1
  int rank = 0;              // REQUIRES: in [0, world_size)
  int64_t lookahead = 0;     // REQUIRES: >= 0
  int64_t num_keys = 0;      // keys must lie in [0, num_keys); REQUIRES: > 0
  bool collective = false;   // collective aggregation: keep the union + S_now, no invalidation
  // Write-back aggregation (logical replication, invariant 10); REQUIRES: collective, and no
  // eviction rule.
  bool replicated = false;
  EvictionRuleOptions eviction;  // virtual tables: the eviction rule (default: none)
};

struct RankPlan {
  int64_t step = 0;
  std::vector<int64_t> unique;     // r's unique keys, first-occurrence order
  std::vector<int64_t> inverse;    // per position of r's batch: index into unique
  std::vector<int64_t> dep;        // per unique key
  std::vector<int64_t> next_use;   // per unique key (invariant 3)
  std::vector<int64_t> prev_use;   // per unique key (invariant 4)
  std::vector<uint8_t> shared;     // per unique key: another rank touches it at this step
  std::vector<int64_t> union_pos;  // per unique key: index into union_keys (collective only)
  std::vector<int64_t> others;     // keys another rank touches at this step whose copy r may
                                   // hold (invariant 5; ps only)
  std::vector<int64_t> union_keys; // every rank's keys, first occurrence in rank order (collective)
  std::vector<uint8_t> s_now;      // per union key: some rank reads it at step + 1 (collective)
  std::vector<int64_t> evicted;    // keys evicted at this step's boundary (invariant 8)
  // Replicated (invariant 10) only: r's own unique keys, first-occurrence order, as indices
  // into unique (the union), and r's batch as indices into them.
  std::vector<int64_t> own_pos;
  std::vector<int64_t> own_inverse;
  int64_t global_ids = 0;          // ids of every rank at this step (duplicates included)
  int64_t union_size = 0;

  // Bytes held by the plan's arrays.
  int64_t MemoryBytes() const;
};

class StepPlanner {
 public:
  // REQUIRES: 1 <= world_size, 0 <= rank < world_size, lookahead >= 0, num_keys >= 1
  // (ValueError naming the field otherwise).
  explicit StepPlanner(const PlannerOptions& options);

  // The options as given.
  const PlannerOptions& options() const { return opt_; }
  int64_t num_steps() const { return next_step_; }        // steps added so far
  int64_t first_retained() const { return first_step_; }  // oldest step still held

  // Adds step num_steps(): rank q's keys are keys[offsets[q], offsets[q + 1]). Another rank's
  // keys may be given as its distinct keys in first-occurrence order (the plan is the same);
  // `global_ids` then states the step's id count with duplicates (< 0: offsets[world_size]).
  // REQUIRES: offsets has world_size + 1 non-decreasing entries, offsets[0] == 0; every key
  // in [0, num_keys) (ValueError naming step, rank, position and value otherwise).
  // Returns the step added.
  int64_t AddStep(const int64_t* keys, const int64_t* offsets, int64_t global_ids = -1);

  // REQUIRES: first_retained() <= step < num_steps().
  const RankPlan& Plan(int64_t step) const;

  // Drops the plans of steps < upto (online mode keeps only the window).
  void Release(int64_t upto);

  int64_t MemoryBytes() const;  // retained plans + per-key state + scratch
  // Keys seen in any step so far (the size of the per-key table).
  int64_t distinct_keys() const { return static_cast<int64_t>(state_.size()); }
  // The virtual table's eviction rule (live rows, created, evicted; invariant 8).
  const EvictionRule& eviction() const { return rule_; }

 private:
  // 16 bytes: the per-key table is the planner's largest random-access structure.
  struct KeyState {
    int32_t last_step = -1;  // last step whose union contains the key
    int32_t union_idx = -1;  // its index in that step's union
    int32_t own_step = -1;   // r's last read
    int32_t own_idx = -1;    // its index in that step's unique keys; -2: the copy from
                             // own_step was invalidated since (ps only)
  };
  RankPlan* Retained(int64_t step);

  PlannerOptions opt_;
  EvictionRule rule_;
  int64_t next_step_ = 0;
  int64_t first_step_ = 0;
  std::deque<RankPlan> plans_;           // steps [first_step_, next_step_)
  FlatMap<KeyState> state_;              // every distinct key seen
  StampedMap<int32_t> step_map_;         // scratch: key -> union index of the step
  struct UnionScratch {
    int32_t nranks;     // ranks touching the key
    int32_t last_rank;  // last rank seen touching it
    int32_t own_local;  // r's unique index, or -1
    int32_t own_first;  // replicated: the key's index in own_pos, or -1
  };
  std::vector<UnionScratch> scratch_;    // scratch per union index
  std::vector<int64_t> union_scratch_;   // scratch: union keys (ps mode)
};

}  // namespace bagpipe::cache
