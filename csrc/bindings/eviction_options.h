// The virtual-table eviction rule's options from Python (a dict or None), shared by the
// StepPlanner binding (cache.cc) and the EvictionRule binding (eviction.cc).
//
// Thread safety: call with the GIL held.
// Invariants:
//   1. None or an empty dict: no eviction; an unknown key is a ValueError naming it.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "cache/eviction_rule.h"
#include "common/errors.h"

namespace bagpipe::bindings {

// REQUIRES: `spec` is None or a dict with keys among threshold, decay_rate, ttl_steps,
// trigger_rows (ValueError naming the key otherwise).
inline cache::EvictionRuleOptions EvictionOptionsFrom(const pybind11::object& spec) {
  cache::EvictionRuleOptions o;
  if (spec.is_none()) return o;
  for (auto item : pybind11::cast<pybind11::dict>(spec)) {
    const std::string key = pybind11::cast<std::string>(item.first);
    if (key == "threshold") {
      o.threshold = pybind11::cast<double>(item.second);
    } else if (key == "decay_rate") {
      o.decay_rate = pybind11::cast<double>(item.second);
    } else if (key == "ttl_steps") {
      o.ttl_steps = pybind11::cast<int64_t>(item.second);
    } else if (key == "trigger_rows") {
      o.trigger_rows = pybind11::cast<int64_t>(item.second);
    } else if (key == "admit_after") {
      o.admit_after = pybind11::cast<int64_t>(item.second);
    } else if (key == "admit_probability") {
      o.admit_probability = pybind11::cast<double>(item.second);
    } else if (key == "max_rows") {
      o.max_rows = pybind11::cast<int64_t>(item.second);
    } else if (key == "admit_seed") {
      o.admit_seed = pybind11::cast<uint64_t>(item.second);
    } else {
      throw ValueError("eviction: unknown option '" + key +
                       "' (threshold, decay_rate, ttl_steps, trigger_rows, admit_after, "
                       "admit_probability, admit_seed, max_rows)");
    }
  }
  return o;
}

}  // namespace bagpipe::bindings
