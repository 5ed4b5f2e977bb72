// EvictionRule: which rows of a virtual table are evicted at a step boundary.
//
// A virtual table (TorchRec's `use_virtual_table=True`) holds a row only from the first step
// that trains it. The rule sees, step by step, the keys each step trains (the union of every
// rank's keys: what the step commits) and decides at the boundary after step s which live
// rows are evicted. It is a pure function of that sequence and the options, so every rank,
// the single-process reference (torchrec_bagpipe.testing.reference_ps) and any replay agree.
// The rule (docs/virtual_tables.md):
//   * A key becomes live when a step trains it; count(k) += 1 and last(k) = s for every key
//     step s trains (once per step, however many ids or ranks read it).
//   * A round runs at the boundary of s when trigger_rows == 0 or live rows > trigger_rows.
//     In a round every live key's count is multiplied by decay_rate (float64; count rule
//     only), then a key is evicted when it was not trained at s and
//       (threshold > 0 and count(k) < threshold)  or  (ttl_steps > 0 and s - last(k) >= ttl_steps).
//   * Evicted keys leave the rule's state (a later training starts a new row: count 1).
//
// Thread safety: none; one owner (the step planner) serializes every call.
//
// Invariants:
//   1. OnStep's output is sorted ascending, holds only keys live before the call that step s
//      did not train, and afterwards live() == live before + new keys - evicted keys.
//   2. Memory: one entry per live key (24 B in a dense array + its map cell); a step-TTL
//      rule (ttl_steps > 0, no count rule, no cap) also keeps a queue of (key, step) touches
//      in step order, compacted to one per live key whenever it (its popped prefix
//      included) would hold more than 2 x live + 32, so a round costs its evictions and
//      the touches it passes, not a scan of the live rows.
//   3. No options (threshold == 0 and ttl_steps == 0): nothing is ever evicted.
//   4. Admission (admit_after > 1 or admit_probability < 1): a key is live only from the step
//      at which it was read in n >= admit_after steps (counted since it was last evicted) and
//      its coin for that n comes up: AdmitCoin(admit_seed, key, n) < admit_probability
//      (a splitmix64 hash, so every rank and the reference draw the same coin); until then it
//      is not trained.
//   5. Cap (max_rows > 0): a round also runs whenever live rows exceed max_rows, and after
//      the threshold / TTL evictions it evicts further keys not trained at s — the oldest
//      last step first, then the lowest count, then the lowest key — until live rows <=
//      max_rows or only keys trained at s remain (live <= max(max_rows, keys of step s)).
#pragma once

#include <cstdint>
#include <vector>

#include "cache/flat_map.h"

namespace bagpipe::cache {

struct EvictionRuleOptions {
  double threshold = 0.0;    // count rule: evict below it (0: no count rule); REQUIRES >= 0
  double decay_rate = 1.0;   // count rule: per-round factor; REQUIRES in (0, 1]
  int64_t ttl_steps = 0;     // step TTL: evict rows not trained for this many steps (0: off)
  int64_t trigger_rows = 0;  // rounds only while live rows exceed it (0: every boundary)
  int64_t admit_after = 0;   // admission: an id is trained only from the step at which it
                             // has appeared in this many steps (<= 1: at once); REQUIRES >= 0
  double admit_probability = 1.0;  // admission: and then with this probability per read
                                   // step (1: always); REQUIRES in (0, 1]
  uint64_t admit_seed = 0;         // admission: the seed of the coins
  int64_t max_rows = 0;  // hard cap on live rows after each round (0: none); REQUIRES >= 0

  bool enabled() const { return threshold > 0.0 || ttl_steps > 0 || max_rows > 0; }
  bool admits() const { return admit_after > 1 || admit_probability < 1.0; }
  bool tracks() const { return enabled() || admits(); }  // keeps the live rows
};

// The admission coin of `key` at its n-th read step (n >= 1) since it last left: a uniform
// double in [0, 1), (splitmix64(seed, key, n) >> 11) * 2^-53.
double AdmitCoin(uint64_t seed, int64_t key, int64_t n);

class EvictionRule {
 public:
  // REQUIRES: threshold >= 0 and finite, decay_rate in (0, 1], ttl_steps >= 0,
  // trigger_rows >= 0 (ValueError naming the field otherwise).
  explicit EvictionRule(const EvictionRuleOptions& options);

  const EvictionRuleOptions& options() const { return opt_; }
  int64_t live() const { return static_cast<int64_t>(rows_.size()); }
  int64_t created() const { return created_; }   // rows ever made live
  int64_t evicted() const { return evicted_; }   // rows ever evicted
  int64_t rounds() const { return rounds_; }     // rounds run
  int64_t MemoryBytes() const;

  // Step `step` trained keys[0, n) (distinct keys); appends the keys evicted at its boundary
  // to *out (sorted ascending). REQUIRES: steps in increasing order; keys distinct, >= 0.
  void OnStep(int64_t step, const int64_t* keys, size_t n, std::vector<int64_t>* out);

  // The count and last trained step of `key` (false: not live). For tests.
  bool Get(int64_t key, double* count, int64_t* last) const;

  // Admission (admit_after > 1): whether `key`, read at the step being added, is trained at
  // it — live, or read in admit_after steps since it last left (this call counts the step).
  // A refused id reads as zeros and its gradient is dropped. REQUIRES: once per key per step,
  // before that step's OnStep.
  bool Admit(int64_t key);

 private:
  struct Row {
    int64_t key;
    double count;
    int64_t last;
  };
  struct Touch {
    int64_t key;
    int64_t step;  // current while the key's row is live with last == step
  };
  // The step-TTL rule's round (invariant 2): pops the touches at least ttl_steps old and
  // appends the keys whose last touch they are to *out.
  void TtlRound(int64_t step, std::vector<int64_t>* out);
  void CompactTouches();
  bool ttl_only() const {
    return opt_.ttl_steps > 0 && opt_.threshold == 0.0 && opt_.max_rows == 0;
  }
  EvictionRuleOptions opt_;
  std::vector<Row> rows_;   // live rows, dense (swap-remove)
  FlatMap<int64_t> index_;  // key -> position in rows_
  FlatMap<int64_t> seen_;   // admission: steps each not-live id was read in
  std::vector<int64_t> positions_;  // OnStep's scratch: each key's row (-1: new)
  std::vector<Touch> touches_;  // ttl_only(): touches in step order, from touches_head_
  size_t touches_head_ = 0;
  int64_t created_ = 0, evicted_ = 0, rounds_ = 0;
  int64_t last_step_ = -1;
};

}  // namespace bagpipe::cache
