#include "cache/eviction_rule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/errors.h"

namespace bagpipe::cache {

EvictionRule::EvictionRule(const EvictionRuleOptions& options) : opt_(options) {
  if (!std::isfinite(opt_.threshold) || opt_.threshold < 0.0) {
    throw ValueError("eviction threshold must be finite and >= 0, got " +
                     std::to_string(opt_.threshold));
  }
  if (!(opt_.decay_rate > 0.0 && opt_.decay_rate <= 1.0)) {
    throw ValueError("eviction decay_rate must lie in (0, 1], got " +
                     std::to_string(opt_.decay_rate));
  }
  if (opt_.ttl_steps < 0) throw ValueError("eviction ttl_steps must be >= 0");
  if (opt_.trigger_rows < 0) throw ValueError("eviction trigger_rows must be >= 0");
  if (opt_.admit_after < 0) throw ValueError("admission admit_after must be >= 0");
  if (opt_.max_rows < 0) throw ValueError("eviction max_rows must be >= 0");
  if (!(opt_.admit_probability > 0.0 && opt_.admit_probability <= 1.0)) {
    throw ValueError("admission admit_probability must lie in (0, 1], got " +
                     std::to_string(opt_.admit_probability));
  }
}

namespace {
uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
}  // namespace

double AdmitCoin(uint64_t seed, int64_t key, int64_t n) {
  const uint64_t h = Mix64(Mix64(Mix64(seed) ^ static_cast<uint64_t>(key)) ^
                           static_cast<uint64_t>(n));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

int64_t EvictionRule::MemoryBytes() const {
  return static_cast<int64_t>(rows_.capacity() * sizeof(Row) + index_.memory_bytes() +
                              seen_.memory_bytes() + touches_.capacity() * sizeof(Touch));
}

void EvictionRule::CompactTouches() {
  // One touch per live row, its last one, in step order (ties in any order: a round's
  // output is sorted).
  touches_.clear();
  touches_.reserve(rows_.size() * 2 + 32);
  for (const Row& r : rows_) touches_.push_back(Touch{r.key, r.last});
  std::sort(touches_.begin(), touches_.end(),
            [](const Touch& a, const Touch& b) { return a.step < b.step; });
  touches_head_ = 0;
}

void EvictionRule::TtlRound(int64_t step, std::vector<int64_t>* out) {
  // Rows with step - last >= ttl_steps are exactly the live rows whose last touch is at or
  // before step - ttl_steps: each has its current touch in the queue (pushed when it was
  // trained, kept by compaction); older touches of a key are stale and skipped.
  const int64_t cutoff = step - opt_.ttl_steps;
  while (touches_head_ < touches_.size() && touches_[touches_head_].step <= cutoff) {
    const Touch t = touches_[touches_head_++];
    const int64_t* pos = index_.Find(t.key);
    if (pos != nullptr && rows_[static_cast<size_t>(*pos)].last == t.step) {
      out->push_back(t.key);
    }
  }
}

bool EvictionRule::Get(int64_t key, double* count, int64_t* last) const {
  const int64_t* i = index_.Find(key);
  if (i == nullptr) return false;
  *count = rows_[static_cast<size_t>(*i)].count;
  *last = rows_[static_cast<size_t>(*i)].last;
  return true;
}

bool EvictionRule::Admit(int64_t key) {
  if (!opt_.admits() || index_.Find(key) != nullptr) return true;
  int64_t* n = seen_.FindOrInsert(key, 0).first;
  if (++*n < opt_.admit_after) return false;
  if (opt_.admit_probability < 1.0 &&
      !(AdmitCoin(opt_.admit_seed, key, *n) < opt_.admit_probability)) {
    return false;
  }
  seen_.Erase(key);
  return true;
}

void EvictionRule::OnStep(int64_t step, const int64_t* keys, size_t n,
                          std::vector<int64_t>* out) {
  if (step <= last_step_) {
    throw ValueError("eviction rule: step " + std::to_string(step) + " after step " +
                     std::to_string(last_step_));
  }
  last_step_ = step;
  if (!opt_.tracks()) return;  // nothing to track (invariant 3)
  // Two passes, each prefetching kAhead keys ahead (both are cache misses on large tables):
  // the index cells, then the rows of the keys already live.
  constexpr size_t kAhead = 16;
  index_.Reserve(n);
  if (rows_.size() + n > rows_.capacity()) {
    rows_.reserve(std::max(rows_.size() + n, 2 * rows_.capacity()));  // geometric growth
  }
  positions_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) index_.Prefetch(keys[i + kAhead]);
    auto [pos, inserted] = index_.FindOrInsert(keys[i], static_cast<int64_t>(rows_.size()));
    if (inserted) {
      rows_.push_back(Row{keys[i], 1.0, step});
      ++created_;
      positions_[i] = -1;
    } else {
      positions_[i] = *pos;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n && positions_[i + kAhead] >= 0) {
      __builtin_prefetch(&rows_[static_cast<size_t>(positions_[i + kAhead])], 1);
    }
    if (positions_[i] < 0) continue;
    Row& r = rows_[static_cast<size_t>(positions_[i])];
    r.count = r.count + 1.0;
    r.last = step;
  }
  if (ttl_only()) {
    if (touches_.size() + n > 2 * rows_.size() + 32) {  // the popped prefix counts too
      CompactTouches();  // after the touches above: it takes every row's last step
    } else {
      for (size_t i = 0; i < n; ++i) touches_.push_back(Touch{keys[i], step});
    }
  }
  if (!opt_.enabled()) return;  // admission only: no rounds
  const bool over_cap = opt_.max_rows > 0 && live() > opt_.max_rows;
  if (opt_.trigger_rows > 0 && live() <= opt_.trigger_rows && !over_cap) return;
  ++rounds_;
  const size_t first = out->size();
  const bool counts = opt_.threshold > 0.0;
  std::vector<size_t> spare;  // the cap's candidates: not trained at `step`, not evicted yet
  if (ttl_only()) TtlRound(step, out);
  for (size_t i = 0; i < (ttl_only() ? 0 : rows_.size()); ++i) {
    Row& r = rows_[i];
    if (counts) r.count = r.count * opt_.decay_rate;
    if (r.last == step) continue;  // trained at this step: kept at its boundary
    if ((counts && r.count < opt_.threshold) ||
        (opt_.ttl_steps > 0 && step - r.last >= opt_.ttl_steps)) {
      out->push_back(r.key);
    } else if (over_cap) {
      spare.push_back(i);
    }
  }
  // The cap (invariant 5): the oldest last step first, then the lowest count, then the key.
  const int64_t after = live() - static_cast<int64_t>(out->size() - first);
  if (opt_.max_rows > 0 && after > opt_.max_rows) {
    const size_t extra =
        std::min(spare.size(), static_cast<size_t>(after - opt_.max_rows));
    auto older = [this](size_t a, size_t b) {
      const Row& x = rows_[a];
      const Row& y = rows_[b];
      if (x.last != y.last) return x.last < y.last;
      if (x.count != y.count) return x.count < y.count;
      return x.key < y.key;
    };
    std::partial_sort(spare.begin(), spare.begin() + static_cast<std::ptrdiff_t>(extra),
                      spare.end(), older);
    for (size_t j = 0; j < extra; ++j) out->push_back(rows_[spare[j]].key);
  }
  std::sort(out->begin() + static_cast<std::ptrdiff_t>(first), out->end());
  for (size_t j = first; j < out->size(); ++j) {
    const int64_t key = (*out)[j];
    const int64_t pos = *index_.Find(key);
    const Row moved = rows_.back();
    rows_[static_cast<size_t>(pos)] = moved;
    *index_.Find(moved.key) = pos;
    rows_.pop_back();
    index_.Erase(key);
  }
  evicted_ += static_cast<int64_t>(out->size() - first);
}

}  // namespace bagpipe::cache
