#include "cache/step_planner.h"

#include <string>

#include "common/errors.h"

namespace bagpipe::cache {

namespace {
constexpr size_t kPrefetchDistance = 16;

template <typename T>
int64_t VecBytes(const std::vector<T>& v) {
  return static_cast<int64_t>(v.capacity() * sizeof(T));
}
}  // namespace

int64_t RankPlan::MemoryBytes() const {
  return VecBytes(unique) + VecBytes(inverse) + VecBytes(dep) + VecBytes(next_use) +
         VecBytes(prev_use) + VecBytes(shared) + VecBytes(union_pos) + VecBytes(others) +
         VecBytes(union_keys) + VecBytes(s_now) + VecBytes(evicted) + VecBytes(own_pos) +
         VecBytes(own_inverse) +
         static_cast<int64_t>(sizeof(RankPlan));
}

StepPlanner::StepPlanner(const PlannerOptions& options)
    : opt_(options), rule_(options.eviction) {
  if (opt_.world_size < 1) throw ValueError("world_size must be >= 1");
  if (opt_.rank < 0 || opt_.rank >= opt_.world_size) {
    throw ValueError("rank must lie in [0, world_size), got " + std::to_string(opt_.rank));
  }
  if (opt_.lookahead < 0) throw ValueError("lookahead must be >= 0");
  if (opt_.num_keys <= 0) throw ValueError("num_keys must be > 0");
  if (opt_.replicated && (!opt_.collective || opt_.eviction.tracks())) {
    throw ValueError("a replicated planner needs collective and no eviction rule");
  }
}

RankPlan* StepPlanner::Retained(int64_t step) {
  if (step < first_step_ || step >= next_step_) return nullptr;
  return &plans_[static_cast<size_t>(step - first_step_)];
}

const RankPlan& StepPlanner::Plan(int64_t step) const {
  if (step < first_step_ || step >= next_step_) {
    throw ValueError("plan of step " + std::to_string(step) + " is not held (held: [" +
                     std::to_string(first_step_) + ", " + std::to_string(next_step_) + "))");
  }
  return plans_[static_cast<size_t>(step - first_step_)];
}

void StepPlanner::Release(int64_t upto) {
  while (first_step_ < upto && !plans_.empty()) {
    plans_.pop_front();
    ++first_step_;
  }
}

int64_t StepPlanner::MemoryBytes() const {
  int64_t bytes = static_cast<int64_t>(state_.memory_bytes() + step_map_.memory_bytes());
  bytes += rule_.MemoryBytes();
  bytes += VecBytes(scratch_) + VecBytes(union_scratch_);
  for (const auto& p : plans_) bytes += p.MemoryBytes();
  return bytes;
}

int64_t StepPlanner::AddStep(const int64_t* keys, const int64_t* offsets,
                             int64_t global_ids) {
  const int world = opt_.world_size;
  const int64_t s = next_step_;
  if (s >= INT32_MAX) throw ValueError("too many steps for one planner (2^31)");
  if (offsets[0] != 0) throw ValueError("offsets[0] must be 0");
  for (int q = 0; q < world; ++q) {
    if (offsets[q + 1] < offsets[q]) throw ValueError("offsets must be non-decreasing");
  }
  const int64_t total = offsets[world];
  for (int q = 0; q < world; ++q) {
    for (int64_t i = offsets[q]; i < offsets[q + 1]; ++i) {
      if (keys[i] < 0 || keys[i] >= opt_.num_keys) {
        throw ValueError("step " + std::to_string(s) + ", rank " + std::to_string(q) +
                         ": key " + std::to_string(keys[i]) + " at position " +
                         std::to_string(i - offsets[q]) + " is outside [0, " +
                         std::to_string(opt_.num_keys) + ")");
      }
    }
  }

  RankPlan plan;
  plan.step = s;
  plan.global_ids = global_ids < 0 ? total : global_ids;
  std::vector<int64_t>& uk = opt_.collective ? plan.union_keys : union_scratch_;
  uk.clear();
  scratch_.clear();
  step_map_.Reset(static_cast<size_t>(total));

  const int64_t own_begin = offsets[opt_.rank];
  const int64_t own_end = offsets[opt_.rank + 1];
  plan.inverse.resize(static_cast<size_t>(own_end - own_begin));

  // Pass 1: the step's union (first occurrence in rank order), how many ranks touch each
  // key, and this rank's unique keys with the inverse of its batch.
  for (int q = 0; q < world; ++q) {
    const bool own = q == opt_.rank;
    for (int64_t i = offsets[q]; i < offsets[q + 1]; ++i) {
      if (static_cast<size_t>(i) + kPrefetchDistance < static_cast<size_t>(total)) {
        step_map_.Prefetch(keys[i + kPrefetchDistance]);
      }
      const int64_t k = keys[i];
      auto [v, inserted] = step_map_.FindOrInsert(k, static_cast<int32_t>(uk.size()));
      if (inserted && !rule_.Admit(k)) *v = -1;  // invariant 9: not trained at this step
      const int32_t idx = *v;
      if (idx < 0) {
        if (own) plan.inverse[static_cast<size_t>(i - own_begin)] = -1;
        continue;
      }
      if (inserted) {
        uk.push_back(k);
        scratch_.push_back(UnionScratch{1, q, -1, -1});
        if (opt_.replicated) {  // invariant 10: every union key is r's, in union order
          scratch_.back().own_local = idx;
          plan.unique.push_back(k);
          plan.union_pos.push_back(idx);
        }
      } else if (scratch_[idx].last_rank != q) {
        scratch_[idx].last_rank = q;
        ++scratch_[idx].nranks;
      }
      if (own && opt_.replicated) {
        UnionScratch& u = scratch_[idx];
        if (u.own_first < 0) {
          u.own_first = static_cast<int32_t>(plan.own_pos.size());
          plan.own_pos.push_back(idx);
        }
        plan.own_inverse.push_back(u.own_first);
      }
      if (own) {
        UnionScratch& u = scratch_[idx];
        if (u.own_local < 0) {
          u.own_local = static_cast<int32_t>(plan.unique.size());
          plan.unique.push_back(k);
          if (opt_.collective) plan.union_pos.push_back(idx);
        }
        plan.inverse[static_cast<size_t>(i - own_begin)] = u.own_local;
      }
    }
  }

  const size_t n_union = uk.size();
  const size_t n_own = plan.unique.size();
  plan.union_size = static_cast<int64_t>(n_union);
  plan.dep.resize(n_own);
  plan.next_use.assign(n_own, -1);
  plan.prev_use.resize(n_own);
  plan.shared.resize(n_own);
  if (opt_.collective) plan.s_now.assign(n_union, 0);
  RankPlan* prev = Retained(s - 1);

  // Pass 2: per union key, the dependency step and this rank's read chain.
  for (size_t idx = 0; idx < n_union; ++idx) {
    if (idx + kPrefetchDistance < n_union) state_.Prefetch(uk[idx + kPrefetchDistance]);
    const int64_t k = uk[idx];
    KeyState* st = state_.FindOrInsert(k, KeyState{}).first;
    const int64_t dep = st->last_step;
    if (opt_.collective && dep == s - 1 && prev != nullptr && st->union_idx >= 0) {
      prev->s_now[st->union_idx] = 1;  // (union_idx < 0: evicted at s - 1, not trained)
    }
    const int64_t own = scratch_[idx].own_local;
    const bool others_touch =
        !opt_.replicated && scratch_[idx].nranks > (own >= 0 ? 1 : 0);
    if (own >= 0) {
      plan.dep[own] = dep;
      plan.shared[own] = others_touch ? 1 : 0;
      const bool chain = st->own_step >= 0 && st->own_idx >= 0;
      plan.prev_use[own] = chain ? st->own_step : -1;
      if (chain && s - st->own_step <= opt_.lookahead) {
        if (RankPlan* p = Retained(st->own_step)) p->next_use[st->own_idx] = s;
      }
      // A copy r still holds (its previous read's, never invalidated since) is stale once
      // another rank touches the key: r must drop it after this step.
      if (!opt_.collective && others_touch && chain) plan.others.push_back(k);
      st->own_step = static_cast<int32_t>(s);
      st->own_idx = (!opt_.collective && others_touch) ? -2 : static_cast<int32_t>(own);
    } else if (!opt_.collective && st->own_step >= 0) {
      if (st->own_idx >= 0) plan.others.push_back(k);
      st->own_idx = -2;
    }
    st->last_step = static_cast<int32_t>(s);
    st->union_idx = static_cast<int32_t>(idx);
  }

  // Invariant 8: the keys evicted at this step's boundary act as a write at s.
  if (opt_.eviction.tracks()) {
    rule_.OnStep(s, uk.data(), n_union, &plan.evicted);
    for (const int64_t k : plan.evicted) {
      KeyState* st = state_.Find(k);  // live keys were trained, so seen
      st->last_step = static_cast<int32_t>(s);
      st->union_idx = -1;
      if (st->own_step >= 0) st->own_idx = -2;
    }
  }
  plans_.push_back(std::move(plan));
  ++next_step_;
  return s;
}

}  // namespace bagpipe::cache
