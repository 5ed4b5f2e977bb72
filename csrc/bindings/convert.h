// Conversions shared by more than one binding file: an init spec from its Python arguments,
// and a shard server's counters as a dict. Errors name the argument (ValueError).
//
// Thread safety: ServerStatsDict needs the GIL; MakeInitSpec is a pure function.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "store/init.h"
#include "transport/server_stats.h"

namespace bagpipe::bindings {

// REQUIRES: kind is 'uniform', 'zeros' or 'constant' (else ValueError naming `init`).
inline store::InitSpec MakeInitSpec(const std::string& kind, float bound, float value,
                                    uint64_t seed, std::vector<int64_t> starts,
                                    std::vector<float> bounds) {
  store::InitSpec init;
  if (kind == "uniform") {
    init.kind = store::InitKind::kUniform;
  } else if (kind == "zeros") {
    init.kind = store::InitKind::kZeros;
  } else if (kind == "constant") {
    init.kind = store::InitKind::kConstant;
  } else {
    throw ValueError("init must be 'uniform', 'zeros' or 'constant', got '" + kind + "'");
  }
  init.bound = bound;
  init.value = value;
  init.seed = seed;
  init.bound_starts = std::move(starts);
  init.bound_values = std::move(bounds);
  return init;
}

// REQUIRES: GIL held. The dict behind ShardServerCore.stats() and UcxShardServerCore.stats().
inline pybind11::dict ServerStatsDict(const transport::ServerStats& st) {
  pybind11::dict d;
  d["accepted"] = st.accepted;
  d["refused"] = st.refused;
  d["active"] = st.active;
  d["frames"] = st.frames;
  d["bytes_in"] = st.bytes_in;
  d["bytes_out"] = st.bytes_out;
  d["closed_by_server"] = st.closed_by_server;
  return d;
}

}  // namespace bagpipe::bindings
