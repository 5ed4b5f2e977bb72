// Deadlines: every native wait is bounded by one (a steady-clock time point).
//
// Thread safety: pure functions of the clock.
//
// Invariants:
//   1. DeadlineAfter never overflows: a non-positive, non-finite or huge number of seconds
//      gives a deadline about 30 years away ("effectively unbounded", still a deadline).
//   2. MillisLeft is in [0, one day] and rounds up, so a poll() on it never returns before
//      the deadline it was computed from (except when capped at one day).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace bagpipe {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// The deadline `seconds` from now (invariant 1).
inline Deadline DeadlineAfter(double seconds) {
  const double s = (seconds > 0 && seconds < 1e9) ? seconds : 1e9;
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Milliseconds left until `deadline`, for poll() (invariant 2).
inline int MillisLeft(Deadline deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
  return static_cast<int>(std::min<int64_t>(ms + 1, 86'400'000));
}

}  // namespace bagpipe
